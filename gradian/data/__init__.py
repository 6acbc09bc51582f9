"""Where the rows come from and what is supervised: sources (JSONL, Parquet, Arrow, a hub dataset), one
row encoded (`encode`), rows read under the token policy (`rows`), batches collated with their
supervision (`batch`), the tokenized corpus. The sample sets shipped with the package are in `samples/`.
"""
