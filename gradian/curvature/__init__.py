"""Second-order statistics of the indexed rows: K-FAC factor sums, per-module second moments, the
whitened projection's factor pass and the per-module width allocation.
"""
