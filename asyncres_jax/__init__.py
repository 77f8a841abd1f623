"""asyncres-jax: bounded-staleness asynchronous Evolution Strategies for LLM agents, in JAX."""

__version__ = "0.1.0"
