"""Models: the per-task handle agents call (``ctx.llm``), routing, and the backends."""
