"""Lightning's checkpoint layout, both ways.

Writing: a full checkpoint carries Lightning's keys beside distrain's (``lightning_keys``), so that
``torch.load(path)["state_dict"]`` and Lightning's own ``load_from_checkpoint`` read it.

Reading: a checkpoint Lightning wrote (a user's run from before the move) resumes under distrain (``as_distrain``):
its ``state_dict`` is the model; its ``optimizer_states``, keyed by position in each parameter group, become keyed by
the parameters' names, as distrain's are; its ``lr_schedulers`` are already what distrain keeps; its loops' counters
become distrain's progress. Lightning keeps no random-number state, so the streams start fresh (a seeded loader
order is the same either way). A checkpoint saved mid-epoch resumes after the batches it had trained on
(``batches_into_epoch``); Lightning's own resume starts its loader over and warns that the results are unreliable.
A checkpoint of Lightning's older layout (no fit loop's progress) is refused in one line.
Every field is someone else's file: each is checked for its type before it counts.
"""

from __future__ import annotations

from typing import Any

#: the Lightning release whose checkpoint layout a file follows: Lightning's own ``load_from_checkpoint`` reads it
LIGHTNING_LAYOUT = "2.6.0"
VERSION_KEY = "pytorch-lightning_version"


def lightning_keys(plain: dict[str, Any]) -> dict[str, Any]:
    """``plain`` with the keys Lightning's checkpoints have and its users read: ``state_dict`` (the model's weights: the
    same tensors as ``model``, which ``torch.save`` stores once), ``epoch``, ``global_step`` and
    ``pytorch-lightning_version`` (what Lightning's own ``load_from_checkpoint`` checks); ``hyper_parameters`` is
    there already. Keys a hook added under those names stay."""
    model = plain.get("model")
    if not isinstance(model, dict):
        return plain
    progress = plain.get("progress") if isinstance(plain.get("progress"), dict) else {}
    counters = {k: progress[k] for k in ("epoch", "global_step") if type(progress.get(k)) is int}
    return {"state_dict": model, **counters, VERSION_KEY: LIGHTNING_LAYOUT, **plain}


def written_by_lightning(loaded: dict[str, Any]) -> bool:
    """Lightning's own checkpoint, its weights under ``state_dict``."""
    return _lightnings(loaded) and isinstance(loaded.get("state_dict"), dict)


def _lightnings(entries: dict[str, Any]) -> bool:
    """Entries of Lightning's own checkpoint: its version, and not distrain's format (whose files carry the version)."""
    return VERSION_KEY in entries and "format" not in entries


def as_distrain(
    loaded: dict[str, Any], model_key: str, optimizers_key: str | None, optimizers: list, names: dict[int, str]
) -> dict[str, Any]:
    """A Lightning checkpoint's entries as distrain's: ``model_key`` the weights, ``optimizers_key`` the states of
    ``optimizers`` (the live ones, whose parameters ``names`` names by ``id``) by parameter name, ``progress`` the
    counters."""
    out = {k: v for k, v in loaded.items() if k not in ("state_dict", "optimizer_states")}
    out[model_key] = loaded["state_dict"]
    saved = loaded.get("optimizer_states")
    if optimizers_key is not None and saved is not None:
        if not isinstance(saved, list) or len(saved) != len(optimizers):
            raise ValueError(
                f"its optimizer_states hold {len(saved) if isinstance(saved, list) else saved!r} optimizer states, "
                f"and configure_optimizers made {len(optimizers)}"
            )
        out[optimizers_key] = [_by_name(s, o, names, n) for n, (s, o) in enumerate(zip(saved, optimizers))]
    if not isinstance(out.get("lr_schedulers"), list):
        out.pop("lr_schedulers", None)
    batch = _fit_loop(loaded).get("epoch_loop.batch_progress", {})
    out["progress"] = {
        "global_step": loaded.get("global_step"),
        "epoch": loaded.get("epoch"),
        "samples_in_epoch": 0,  # its batches into the epoch count once the batch layout is known
        "epoch_done": batch.get("is_last_batch") is True,
    }
    return out


def batches_into_epoch(extra: dict[str, Any]) -> int | None:
    """The batches of its epoch a checkpoint Lightning wrote had trained on on each rank (their steps had run:
    ``processed``); None for any other checkpoint. Lightning records no world size: a checkpoint saved mid-epoch
    resumes at its place on the world size it was saved on."""
    if not _lightnings(extra):
        return None
    batch = _fit_loop(extra).get("epoch_loop.batch_progress")
    current = batch.get("current") if isinstance(batch, dict) else None
    done = current.get("processed") if isinstance(current, dict) else None
    if type(done) is not int or done < 0:
        raise ValueError(f"its loops' processed batches are {done!r}, not a count")
    return done


def _fit_loop(loaded: dict[str, Any]) -> dict[str, Any]:
    loops = loaded.get("loops")
    fit = loops.get("fit_loop") if isinstance(loops, dict) else None
    return fit if isinstance(fit, dict) else {}


def _by_name(saved: Any, optimizer, names: dict[int, str], index: int) -> dict[str, Any]:
    """``optimizer.state_dict()``'s layout (state and groups by position) as distrain's (by parameter name)."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    state = saved.get("state") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not isinstance(state, dict) or len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"its optimizer state {index} is not one of an optimizer with {len(optimizer.param_groups)} parameter "
            "group(s)"
        )
    by_name: dict[str, Any] = {}
    named_groups = []
    for g, (group, live) in enumerate(zip(groups, optimizer.param_groups)):
        positions = group.get("params") if isinstance(group, dict) else None
        if not isinstance(positions, list) or not all(type(i) is int for i in positions):
            raise ValueError(f"its optimizer state {index}, group {g}, names its parameters otherwise than by position")
        if len(positions) != len(live["params"]):
            raise ValueError(
                f"its optimizer state {index}, group {g}, holds {len(positions)} parameters, and the model's optimizer "
                f"{len(live['params'])}"
            )
        if any(id(p) not in names for p in live["params"]):
            raise ValueError(f"the model's optimizer {index} holds a parameter that is not the model's")
        group_names = [names[id(p)] for p in live["params"]]
        for position, name in zip(positions, group_names):
            if position in state:
                by_name[name] = state[position]
        named_groups.append({**group, "params": group_names})
    return {"state": by_name, "param_groups": named_groups}
