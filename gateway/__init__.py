"""splitserve gateway: public gRPC Generation API, OpenAI REST bridge, admission control,
replica routing. Entry point: `python -m gateway` (gateway/server.py)."""
