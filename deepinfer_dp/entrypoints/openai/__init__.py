"""The OpenAI-compatible HTTP server: build_app (server.py) over any EngineClient."""
