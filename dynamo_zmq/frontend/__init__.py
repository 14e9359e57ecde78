"""The OpenAI-compatible HTTP frontend: request parsing, preprocessing, models and serving."""
