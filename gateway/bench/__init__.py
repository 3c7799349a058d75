"""`loragw bench`: a serving benchmark in the manner of vLLM's `vllm bench serve` (client.py),
its settings (config.py), the pure summary and table (report.py), and the server it starts
when given no --url (server.py). Nothing is imported here: server.py (`free_port`,
`wait_ready`) stays cheap to import, without the engine the client's settings import."""
