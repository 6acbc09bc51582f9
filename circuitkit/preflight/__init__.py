"""The memory preflight: model shapes and shared memory terms (`memory`), and the preflight
stage that sums the estimates the stages declare (`stage`). Imports no domain."""
