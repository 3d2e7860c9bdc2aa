"""The planner, pure numpy and no torch: model and machine specs, the candidate space, the cost model
(compute, communication, memory, the batch-time combiner) and the ranking."""
