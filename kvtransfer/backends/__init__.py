"""The KV transfer backends (the map is in kvtransfer/__init__.py)."""
