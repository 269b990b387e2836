"""meshlm: a distributed LLM training stack where every technique states what it saves and what it costs."""

__version__ = "0.1.0"
