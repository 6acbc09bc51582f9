"""Building an index: the loop over the corpus, its checks and resume, rows handed to the writer
thread, batches sized to the device, the memory estimate and the width table.
"""
