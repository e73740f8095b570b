"""Speculative decoding: the decode loop, drafters, exact rejection sampling, sampling and the K policy."""
