"""Structured outputs: what a request's output must match (``spec``), the grammar engine that compiles it
(``grammar``: llguidance, the optional ``structured`` extra) and how a round masks, cuts and fast-forwards
drafts with it (``masks``)."""
