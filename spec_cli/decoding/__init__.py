"""Decoding strategies, each a generator of events, and what they share: sampling, acceptance, the
controller."""
