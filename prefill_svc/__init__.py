"""Prefill service: runs prompts (prefill_only, prefix cache on), pushes their KV to the decode
service named in the transfer ticket, answers the first token.

Request lifecycle here: waiting -> running (engine prefill) -> sending (KV push) -> released.
"""
