"""OpenAI's Responses API (POST /v1/responses, stateless): a request as the chat request it
means, through the same admission; its output items and typed stream events."""
