"""What the HTTP routes share: keys and callers (auth), OpenAI-shaped errors and response
bodies, a request's engine streams (jobs), the OpenAPI additions, the upload body's own limits,
the SERVER span, and the operations routes (/health, /ready, /metrics)."""
