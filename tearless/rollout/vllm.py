"""The vLLM rollout engine (``actor_rollout_ref.rollout.name=vllm``): GPU generation with per-token
log-probs, sleep mode around training, and the new weights loaded in the worker's own process.

vLLM needs a CUDA GPU and a torch build matching its wheel (vLLM 0.33 pins torch 2.14.0); it cannot
be installed on the CPU machines this project is developed on, so this engine has been written
against vLLM's public API as of 0.33 (``LLM``, ``SamplingParams``, ``LLM.sleep``/``wake_up``,
``LLM.collective_rpc``, ``LLM.reset_prefix_cache``, the ``logprobs_mode`` engine argument) and is
tested only where ``import vllm`` works (``tests/rollout/test_vllm.py``, skipped elsewhere).

Each worker owns one engine on its GPU, in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
the engine core and its single worker run in this process), so ``collective_rpc`` with a function
runs that function on the engine's worker here: the trainer's tensors go to the engine model's
``load_weights`` by reference, one at a time, with no pickling and no CPU round trip.
Log-probs are requested as ``processed_logprobs``: those of the temperature-scaled distribution the
tokens were drawn from, which is what the trainer recomputes for the PPO ratio (with top-k/top-p
off; with them on, vLLM's log-probs are those of the filtered distribution). Their mismatch with
the trainer's is measured every step (``rollout_corr/*``, :mod:`tearless.rollout.correction`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence

import torch

from tearless.rollout.hf import RolloutOutput, left_pad


def _missing_vllm(exc: ImportError) -> ImportError:
    return ImportError(
        "actor_rollout_ref.rollout.name=vllm: vllm cannot be imported "
        f"({exc}). Install it on a CUDA machine with pip install 'tearless[vllm]', "
        "or use actor_rollout_ref.rollout.name=hf."
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


class VLLMRollout:
    """Generate with a vLLM ``LLM`` built from a ``save_pretrained`` directory; same interface as
    :class:`tearless.rollout.hf.HFRollout` plus ``update_weights``, ``sleep`` and ``wake_up``."""

    def __init__(
        self,
        model_path: str,
        cfg,
        *,
        dtype: str,
        eos_token_ids: list[int],
        pad_token_id: int,
        seed: int,
    ) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM
        except ImportError as exc:
            raise _missing_vllm(exc) from exc
        self.cfg, self.eos, self.pad_token_id = cfg, sorted(set(eos_token_ids)), pad_token_id
        self.sync_timeout_s = cfg.weight_sync_timeout_s
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            tensor_parallel_size=1,
            enable_sleep_mode=cfg.free_cache_engine,
            logprobs_mode="processed_logprobs",
        )
        self.asleep, self.weights_awake = False, True
        self.sleep()

    # ------------------------------------------------------------------ hybrid engine
    def sleep(self) -> None:
        """Release the KV cache and offload the weights to CPU while training runs (level 1 keeps a
        CPU copy of the weights, so waking needs no reload). No-op without ``free_cache_engine``."""
        if self.cfg.free_cache_engine and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep, self.weights_awake = True, False

    def wake_up(self) -> None:
        """Bring back whatever is asleep: the KV cache, and the weights unless a sync woke them."""
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"] if self.weights_awake else None)
            self.asleep, self.weights_awake = False, True

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load named tensors (Hugging Face parameter names; ``load_weights`` fuses q/k/v and gate/up
        itself) into the engine's model in this process, within
        ``actor_rollout_ref.rollout.weight_sync_timeout_s``; then drop cached prefixes computed with
        the old weights."""

        def load() -> None:
            if not self.weights_awake:  # load into GPU memory, not into the sleeping engine's freed pages
                self.llm.wake_up(tags=["weights"])
                self.weights_awake = True
            self.llm.collective_rpc(_load_into_worker, args=(weights,))
            self.llm.reset_prefix_cache()

        run_with_timeout(
            load, self.sync_timeout_s, "vLLM weight load", "actor_rollout_ref.rollout.weight_sync_timeout_s"
        )

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
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
    ) -> RolloutOutput:
        """``n`` responses per prompt (rows of a prompt adjacent), with their sampling log-probs.

        Each prompt is one request seeded from its key (:mod:`tearless.rollout.seeds`), so a prompt
        draws the same responses in any worker and any batch (vLLM seeds each request's own
        generator; the logits themselves can differ in the last bits between batch shapes).
        """
        from vllm import SamplingParams

        seeds = [None] * len(prompts) if keys is None else [k % (2**63 - 1) for k in keys]
        params = [
            SamplingParams(
                n=n,
                temperature=temperature if do_sample else 0.0,
                top_p=top_p if do_sample else 1.0,
                top_k=top_k if do_sample and top_k > 0 else 0,  # 0 disables top-k in vLLM
                max_tokens=max_new_tokens,
                logprobs=0,
                seed=seed,
                stop_token_ids=self.eos,
                detokenize=False,
            )
            for seed in seeds
        ]
        self.wake_up()
        try:
            results = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        finally:
            self.sleep()
        return self.pack(prompts, n, results)

    def pack(self, prompts: list[list[int]], n: int, results) -> RolloutOutput:
        """vLLM ``RequestOutput``s → a right-padded :class:`RolloutOutput` (EOS kept in the mask)."""
        expanded = [p for p in prompts for _ in range(n)]
        prompt_ids, prompt_mask = left_pad(expanded, self.pad_token_id)
        outputs = [c for r in results for c in r.outputs]
        width = max(1, max(len(c.token_ids) for c in outputs))
        rows = len(outputs)
        ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        logps = torch.zeros((rows, width), dtype=torch.float32)
        truncated = torch.zeros(rows, dtype=torch.bool)
        for i, c in enumerate(outputs):
            length = len(c.token_ids)
            ids[i, :length] = torch.tensor(list(c.token_ids), dtype=torch.long)
            mask[i, :length] = 1
            if c.logprobs is not None:
                logps[i, :length] = torch.tensor(
                    [step[tok].logprob for tok, step in zip(c.token_ids, c.logprobs, strict=True)]
                )
            truncated[i] = c.finish_reason == "length"
        return RolloutOutput(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=ids,
            response_mask=mask,
            log_probs=logps,
            truncated=truncated,
        )


def _load_into_worker(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Run by ``LLM.collective_rpc`` on the engine's worker (in this process)."""
    worker.get_model().load_weights(weights=weights)
