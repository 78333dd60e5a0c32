"""HF transformers' greedy continuation of token-id prompts: the oracle of the parity tests."""
import torch


def hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    out = []
    for p in prompts:
        x = torch.tensor([p])
        with torch.no_grad():
            g = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(g[0, len(p):].tolist())
    return out
