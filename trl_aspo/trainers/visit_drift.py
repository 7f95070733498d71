"""SPO's KL-adaptive forgetting factor (`value_rho_mode="kl"`, arXiv 2509.13232; the SPO authors' reference code,
verl-recipe `spo/spo_ray_trainer.py`, `_get_spo_rho`): how far the policy has moved since a prompt's previous visit.

Per prompt, the completion of its last visit is stored (on CPU) with its log-probs under the policy right after the
update that used it. At the next visit, after this visit's update,

    D = masked mean |lp_stored - lp_now| over the stored completion's action tokens,   rho = clip(2^(-D / D_half),
    rho_min, rho_max)

(`trl_aspo.values.kl_rho.logprob_drift`, `kl_adaptive_rho`); a first visit has D = 0. A round's outcomes therefore
wait ("pending") for the updates that use it, and enter the tracker at the next dispatch. The synchronous trainer
owns the pending round and the store; `VisitDrift` snapshots, measures and closes them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from accelerate.utils import gather_object

from trl_aspo.trainers.multimodal_visits import batch_multimodal_inputs, split_multimodal_inputs
from trl_aspo.values.kl_rho import kl_adaptive_rho, logprob_drift
from trl_aspo.values.visit_tracker import VisitValueTracker


class VisitDrift:
    """`forward(input_ids, attention_mask, logits_to_keep, multimodal) -> (n, logits_to_keep)` log-probs under the
    current policy (the trainer's forward pass, identical on every rank); `accelerator` gathers across ranks."""

    def __init__(self, args, accelerator, forward: Callable) -> None:
        self.args = args
        self.accelerator = accelerator
        self.forward = forward

    def snapshot(self, output, keys, outcomes, scorable) -> dict:
        """This round's visit, held until the updates that use it are done: the gathered keys, outcomes and scorable
        flags, and each local completion trimmed to its own tokens (prompt without padding, completion up to its
        last token, action mask) on CPU, with its own multimodal inputs under `multimodal` for a vision-language
        model (the whole round's images would not match the rows of a later, mixed batch)."""
        completion_mask = output["completion_mask"]
        action_mask = completion_mask * output.get("tool_mask", 1)
        lengths = [
            int(row_mask.nonzero().max()) + 1 if row_mask.any() else 0 for row_mask in completion_mask.unbind(0)
        ]
        multimodal = split_multimodal_inputs(output, output["prompt_mask"], lengths)
        completions = []
        for row, length in enumerate(lengths):
            completion = {
                "prompt_ids": output["prompt_ids"][row][output["prompt_mask"][row].bool()].to("cpu", torch.int32),
                "completion_ids": output["completion_ids"][row, :length].to("cpu", torch.int32),
                "action_mask": action_mask[row, :length].to("cpu", torch.bool),
            }
            if multimodal[row]:
                completion["multimodal"] = multimodal[row]
            completions.append(completion)
        start = self.accelerator.process_index * len(completions)
        return {
            "keys": list(keys),
            "local_keys": list(keys[start : start + len(completions)]),
            "outcomes": outcomes.double().cpu(),
            "scorable": scorable.cpu(),
            "completions": completions,
        }

    @torch.no_grad()
    def _logps(self, visits: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """Current-policy log-probs of stored visits' completion tokens, (n, T) float32 on CPU, and their action masks.

        Each row is prompt + completion from position 0, right-padded: the log-probs do not depend on which other
        visits share the batch (left padding would shift the positions). Each visit brings its own multimodal inputs,
        batched in row order."""
        lengths = [len(v["prompt_ids"]) + len(v["completion_ids"]) for v in visits]
        width = max(lengths)
        input_ids = torch.zeros(len(visits), width, dtype=torch.long)
        attention_mask = torch.zeros(len(visits), width, dtype=torch.long)
        for row, visit in enumerate(visits):
            input_ids[row, : lengths[row]] = torch.cat([visit["prompt_ids"], visit["completion_ids"]]).long()
            attention_mask[row, : lengths[row]] = 1
        device = self.accelerator.device
        multimodal = batch_multimodal_inputs([visit.get("multimodal", {}) for visit in visits], width)
        logps = self.forward(
            input_ids.to(device),
            attention_mask.to(device),
            width - 1,
            {key: value.to(device) if torch.is_tensor(value) else value for key, value in multimodal.items()},
        )
        # logps[:, j] is the log-prob of token j + 1.
        completion_width = max(1, max(len(v["completion_ids"]) for v in visits))
        out = torch.zeros(len(visits), completion_width, dtype=torch.float32)
        mask = torch.zeros(len(visits), completion_width, dtype=torch.bool)
        for row, visit in enumerate(visits):
            start, length = len(visit["prompt_ids"]) - 1, len(visit["completion_ids"])
            out[row, :length] = logps[row, start : start + length].float().cpu()
            mask[row, :length] = visit["action_mask"]
        return out, mask

    @torch.no_grad()
    def _measure(self, pending: dict, visit_store: dict) -> dict:
        """Close a pending round against `visit_store` (collective: every rank runs one forward of the same size).

        Per completion of the round: D since its prompt's previous visit (the stored completion's log-probs then and
        now; D = 0 on a first visit), and the visit to store next (this completion with its post-update log-probs).
        Returns gathered `drift`, `first_visit` and `visits`, in the order of the round's keys."""
        local = pending["completions"]
        previous = [visit_store.get(key) for key in pending["local_keys"]]
        first_visit = torch.tensor([visit is None for visit in previous])
        # A first visit stands in for itself (D = 0), so every rank runs one batch of 2 x its local size.
        stored = [visit if visit is not None else own for visit, own in zip(previous, local, strict=True)]
        logps_now, mask = self._logps(stored + local)
        stored_logps = torch.zeros_like(logps_now[: len(local)])
        for row, visit in enumerate(stored):
            if "logps" in visit:
                stored_logps[row, : len(visit["logps"])] = visit["logps"]
        drift = logprob_drift(stored_logps, logps_now[: len(local)], mask[: len(local)])
        drift = torch.where(first_visit, torch.zeros_like(drift), drift)
        visits = [
            {**own, "logps": logps_now[len(local) + row, : len(own["completion_ids"])].clone()}
            for row, own in enumerate(local)
        ]
        device = self.accelerator.device
        return {
            "drift": self.accelerator.gather(drift.to(device)).cpu(),
            "first_visit": self.accelerator.gather(first_visit.to(device)).cpu(),
            "visits": gather_object(visits),
        }

    def close(self, pending: dict, tracker: VisitValueTracker, visit_store: dict) -> dict:
        """SPO's KL-adaptive update of `tracker` and `visit_store` for a pending round (collective); returns the
        round's scorable `drift`, `rho` and `first_visit`."""
        closed = self._measure(pending, visit_store)
        scorable = pending["scorable"]
        drift = closed["drift"][scorable]
        rho = kl_adaptive_rho(
            drift, d_half=self.args.value_kl_half, rho_min=self.args.value_rho_min, rho_max=self.args.value_rho_max
        )
        keys = [key for key, ok in zip(pending["keys"], scorable.tolist(), strict=True) if ok]
        tracker.observe(keys, pending["outcomes"][scorable], rho)
        # A prompt seen twice in one round keeps its last completion, as the reference does.
        for key, visit, ok in zip(pending["keys"], closed["visits"], scorable.tolist(), strict=True):
            if ok:
                visit_store[key] = visit
        return {"drift": drift, "rho": rho, "first_visit": closed["first_visit"][scorable]}
