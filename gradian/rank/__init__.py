"""Ranking training rows against queries: the scores streamed over the shards, the compatibility checks
of a query against an index, the query gradients, the results, and one row's tokens (`inspect --row`).
"""
