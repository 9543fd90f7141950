"""Run a recipe's stages in order: the target loaded once, finished stages skipped, interrupted ones
resumed.

Every stage's inputs are fingerprinted (the model section, its own sections, and its upstream stages'
fingerprints with the id of the run that wrote their outputs). After a stage finishes, `<out>/.stages/<name>.json` records its fingerprint and the
files it wrote; a later run skips it while both still match, so editing a section re-runs that stage
and everything downstream of it. A stage that runs again resumes from what it had finished (each
stage keeps its own partial work: calibrated blocks, sample shards, checkpoints, measurements).
"""
from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from polybasic._lazy import load_entry
from polybasic.artifacts import announce, clean_and_announce, write_json
from polybasic.config import dump_recipe, load_recipe, to_dict
from polybasic.errors import ConfigError
from polybasic.pipelines.stages import NAMES, STAGES, Stage
from polybasic.quant.api import load_any_model
from polybasic.runtime.context import ExecutionContext

RECORDS = ".stages"


@dataclass
class StageContext:
    """What a stage runs with: the recipe, its output folder, the stages of this run, and the
    target, loaded on first use and shared by every stage."""

    recipe: object  # config.Recipe
    out: Path
    stages: tuple[str, ...]
    recipe_path: str = ""
    execution: ExecutionContext | None = None  # model.device and model.dtype, checked (default: made from them)
    _target: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        m = self.recipe.model
        self.execution = self.execution or ExecutionContext(m.device, m.dtype, flag="model.device")

    @property
    def target(self):
        """The recipe's model (models.loader.LoadedModel) in its dtype on its device, loaded once; the
        stages build their levels where it is. 'NAME@w4a8' runs the GGUF's own codes (quant.load_any_model)."""
        if self._target is None:
            self._target = load_any_model(self.recipe.model.source, self.execution.dtype, self.execution.device)
        return self._target


def fingerprint(st: Stage, recipe, upstream: dict[str, str]) -> str:
    """sha256 of a stage's inputs: the model, its sections, its upstream stages' fingerprints."""
    model = to_dict(recipe.model)
    if model.get("device") == "cpu":  # the default: fingerprints stay those of runs made before the field
        del model["device"]
    inputs = {"stage": st.name, "model": model,
              "sections": {s: to_dict(getattr(recipe, s)) for s in st.sections},
              "upstream": {u: upstream.get(u) for u in st.needs}}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def stage_record(out: Path, name: str) -> dict | None:
    """The record a stage's last run left in out (None: none, or unreadable)."""
    path = out / RECORDS / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _made(rec: dict) -> str:
    """A stage's outputs as its downstream stages see them: its inputs' fingerprint and the run that
    wrote them, so a stage that ran again (its outputs may differ: re-measured, new code) makes the
    stages after it run again too. Records of older runs have no run id: their fingerprint alone."""
    return rec["fingerprint"] + (f":{rec['run_id']}" if rec.get("run_id") else "")


def _done(out: Path, rec: dict | None, fp: str) -> bool:
    return bool(rec) and rec.get("fingerprint") == fp and all((out / p).exists() for p in rec.get("outputs", []))


def require(out: Path, rel: str, writer: str, upstream: set[str], stage: str) -> None:
    """A stage's input file `<out>/<rel>` exists, unless stage `writer` makes it earlier in this run."""
    path = Path(out) / rel
    if writer not in upstream and not path.exists():
        raise ConfigError(f"{stage}: {path} does not exist; run `polybasic {writer}` on this recipe first "
                          "(or `polybasic run`)")


def check_inputs(recipe, out: Path, names: tuple[str, ...]) -> None:
    """Every stage's cheap checks (its data, the files it reads that no earlier stage of this run
    writes), before any model loads."""
    for i, name in enumerate(names):
        module = next(s for s in STAGES if s.name == name).entry.partition(":")[0]
        load_entry(f"{module}:check_inputs")(recipe, out, set(names[:i]))


def run_recipe(recipe_path: str | Path, out_dir: str | Path | None = None,
               only: tuple[str, ...] | None = None, overrides: tuple[str, ...] = ()) -> StageContext:
    """Run the recipe's stages (or only `only`), in the table's order. recipe_path: a YAML file or a
    shipped recipe's name; overrides: `section.field=value` items (`--set`)."""
    recipe = load_recipe(recipe_path, overrides)
    names = tuple(n for n in NAMES if n in (only or recipe.stages))
    if only and not names:
        raise ConfigError(f"stages: none of {list(only)} is a stage; use {', '.join(NAMES)}")
    out = Path(out_dir or recipe.out_dir)

    # the run's one execution context: a missing GPU fails before any stage
    execution = ExecutionContext(recipe.model.device, recipe.model.dtype, flag=f"{recipe_path}: model.device")
    check_inputs(recipe, out, names)
    out.mkdir(parents=True, exist_ok=True)
    clean_and_announce(out)
    dump_recipe(recipe, out / "recipe.yaml")
    ctx = StageContext(recipe, out, names, str(recipe_path), execution)
    fps: dict[str, str] = {}  # what each stage's outputs are, for the stages downstream of it
    for st in STAGES:
        if st.name not in names:
            rec = stage_record(out, st.name)  # a stage run before, on its own: its outputs feed this run
            if rec:
                fps[st.name] = _made(rec)
            continue
        fp = fingerprint(st, recipe, fps)
        rec = stage_record(out, st.name)
        if _done(out, rec, fp):
            fps[st.name] = _made(rec)
            announce(f"[{st.name}] skipped: its outputs match its inputs (fingerprint {fp[:12]})")
            continue
        announce(f"[{st.name}] {st.help}")
        t0 = time.perf_counter()
        outputs = load_entry(st.entry)(ctx)
        rel = [str(Path(p).resolve().relative_to(out.resolve())) for p in outputs]
        wall = time.perf_counter() - t0
        rec = {"fingerprint": fp, "outputs": rel, "wall_s": round(wall, 3),  # ms: a tiny stage is not 0 s
               "run_id": uuid.uuid4().hex}
        write_json(out / RECORDS / f"{st.name}.json", rec, indent=1)
        fps[st.name] = _made(rec)
        announce(f"[{st.name}] done in {wall:.1f} s: {', '.join(rel)}")
    return ctx
