"""The index on disk: its typed header, the shard store (writer, reader, verify), the row formats
(`formats/`) and the curvature file computed from the shards.
"""
