"""The vLLM rollout engine (``actor_rollout_ref.rollout.name=vllm``): GPU generation with per-token
log-probs, sleep mode around training, and weight sync from the trainer.

vLLM needs a CUDA GPU and a torch build matching its wheel; it cannot be installed on the CPU
machines this project is developed on, so this engine has only been written against vLLM's public
API (``LLM``, ``SamplingParams``, ``LLM.sleep``/``wake_up``, ``LLM.reset_prefix_cache``) and is
tested only where ``import vllm`` works (``tests/rollout/test_vllm.py``, skipped elsewhere).

The engine runs in the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that updated
weights can be loaded into its model in place (``model.load_weights``), without a disk round trip.
Log-probs are requested as ``processed_logprobs``: those of the temperature-scaled distribution the
tokens were drawn from, which is what the trainer recomputes for the PPO ratio (with top-k/top-p
off; with them on, vLLM's log-probs are those of the filtered distribution). Their mismatch with
the trainer's is measured every step (``rollout_corr/*``, :mod:`tearless.rollout.correction`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

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
            tensor_parallel_size=cfg.tensor_model_parallel_size,
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
    def _model(self) -> torch.nn.Module:
        return self.llm.llm_engine.model_executor.driver_worker.model_runner.model

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load the trainer's consolidated weights into the engine (``load_weights`` takes Hugging
        Face parameter names and fuses q/k/v and gate/up itself), within
        ``actor_rollout_ref.rollout.weight_sync_timeout_s``; then drop cached prefixes computed with
        the old weights."""

        def load() -> None:
            if not self.weights_awake:  # load into GPU memory, not into the sleeping engine's freed pages
                self.llm.wake_up(tags=["weights"])
                self.weights_awake = True
            if self.cfg.tensor_model_parallel_size > 1:
                items = list(state_dict.items())
                self.llm.collective_rpc(lambda worker: worker.model_runner.model.load_weights(items))
            else:
                self._model().load_weights(state_dict.items())
            self.llm.reset_prefix_cache()

        run_with_timeout(
            load, self.sync_timeout_s, "vLLM weight sync", "actor_rollout_ref.rollout.weight_sync_timeout_s"
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
        generator: torch.Generator | None = None,
    ) -> RolloutOutput:
        """``n`` responses per prompt (rows of a prompt adjacent), with their sampling log-probs.

        The request seed is drawn from ``generator``, so a seeded step draws the same seed again on
        resume (vLLM's sampling itself is reproducible only on the same GPU and batch).
        """
        from vllm import SamplingParams

        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator)) if generator is not None else None
        params = SamplingParams(
            n=n,
            temperature=temperature if do_sample else 0.0,
            top_p=top_p if do_sample else 1.0,
            top_k=top_k if do_sample else -1,
            max_tokens=max_new_tokens,
            logprobs=0,
            seed=seed,
            stop_token_ids=self.eos,
            detokenize=False,
        )
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
