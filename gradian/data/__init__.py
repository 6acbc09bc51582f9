"""Where the rows come from and what is supervised: sources (JSONL, Parquet, Arrow, a hub dataset), rows
tokenized under the token policy and collated with their supervision, the tokenized corpus. The
sample sets shipped with the package are in `samples/`.
"""
