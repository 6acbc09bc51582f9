"""Pruning a scored graph to a circuit: head and edge pruning, selection rules, the learned
masks, the integer program, stability and the pruning stage's memory estimate."""
