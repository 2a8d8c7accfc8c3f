"""The parallel toolbox: FSDP2 sharding and loading (``fsdp``) and the weight broadcast of the split
placement (``weight_sync``), over ``torch.distributed`` only. No Ray here: the Ray worker group sits
beside the :class:`~tearless.workers.group.WorkerGroup` it extends (``tearless.workers.ray_group``),
and which placement a config asks for is a config fact (:func:`tearless.config.derived.uses_ray`).
"""
