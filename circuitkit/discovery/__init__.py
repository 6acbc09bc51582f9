"""Circuit discovery: tasks, attribution, pruning and selection, exports, and their stages."""
