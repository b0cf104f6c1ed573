"""Several devices and several processes: the device mesh and parameter sharding (``sharding``, on
``jax.sharding``) and the processes of a multi-host run (``multihost``, on ``jax.distributed``)."""
