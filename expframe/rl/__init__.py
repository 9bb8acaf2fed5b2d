"""Reinforcement learning pieces: environments, replay, n-step adders, actors, losses.

  environments.py   DeepMind Control Suite tasks, flat state observations (`control_suite`)
  sum_tree.py       proportional sampling in O(log n)
  replay.py         prioritised replay with a capacity bound
  adders.py         n-step transitions from episodes
  actors.py         a noisy policy acting in an environment, feeding replay
  rpc.py            the learner's RPC service for actor processes: weights out, transitions in
  actor_process.py  an actor process (`python -m expframe.rl.actor_process`) fed over RPC
  actor_pool.py     the learner's K actor processes: start, watch, restart, stop
  learner_input.py  replay samples as a tf.data input
  losses.py         categorical projection, distributional TD, deterministic policy gradient
"""
