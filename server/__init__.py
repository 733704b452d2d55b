"""The OpenAI-compatible server behind `spd serve`: app, engine loop, requests, responses, metrics."""
