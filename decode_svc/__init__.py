"""Decode service: reserves KV blocks, receives prefill's KV, runs the continuous-batching
decode loop (engine thread) and streams tokens.

Request lifecycle here: reserved -> receiving -> running -> finished (see servicer.py).
"""
