"""Pipeline parallelism: a node's layers spread over rank processes.

rank 0 (leader.py) schedules and sends each microbatch's description ahead of its hidden
states; ranks 1..P-1 (follower.py) execute what they are told; the last rank samples and
sends the tokens back to rank 0. node.py starts the ranks and is the node's front.
"""
