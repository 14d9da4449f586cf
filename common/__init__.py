"""What the HTTP edges share: the OpenAI error shape, reading a client's or a peer's body within a
budget, one JSON object per log line. The worker's server, the router and the operator import it;
it imports nothing of theirs, and nothing beyond the core dependencies (aiohttp, pydantic), so the
router and the operator load it without torch."""
