"""Closing the loop on a cluster: launch configs emitted for a candidate, the validation sweep that runs
the top candidates with the bundled trainer and scores the ranking, and refit of the profile from it."""
