"""The HTTP surface: the Litestar app, its controllers (OpenAI, Responses, admin, tenants, ops)
and what they share (admission, prompts, formats, errors, auth)."""
