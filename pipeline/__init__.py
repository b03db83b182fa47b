"""The pipeline-parallel runtime: a node's layers spread over rank processes.

group.py starts the ranks (`RankGroup`) and is the node's handle on them. Rank 0 runs
rank0.py (`Rank0Loop`, the node's only scheduler): it sends each microbatch's description
(log.py: the log entries since the last one, and the batch) ahead of its hidden states; ranks
1..P-1 run stage.py (`StageLoop`): apply the entries, run their layers, and the last rank samples
and sends the tokens back to rank 0. control.py carries consensus between the ranks.
"""
