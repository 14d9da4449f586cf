"""The rank processes of a tensor-parallel group and what runs them (vLLM's executor): the
launcher (spawns a host's ranks, watches them, drives rank 0), a rank's process, and a follower
node's entry point. Above model/ (a rank runs the model runner) and below engine/."""
