"""splitserve command line: up / gateway / prefill / decode / generate / chat."""
