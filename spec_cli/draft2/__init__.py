"""The second stage: drafts without a model (prompt lookup) or cheaper than the draft (n-grams, a trigram)."""
