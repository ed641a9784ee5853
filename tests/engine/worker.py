"""The engine environment's half of the engine test tier. Run by the engine venv's Python (it
imports torch, transformers, peft and vLLM, none of which the test venv has); the tests call it
as a subprocess and exchange JSON files with it. Standard library and engine packages only.

    python worker.py assets SPEC.json OUT_DIR
        Build the tiny base model (random Llama, byte-level tokenizer; nothing downloaded), the
        PEFT adapters SPEC lists, and the reference text of every adapter folder SPEC
        names: greedy generation with transformers + peft, no vLLM involved.
    python worker.py references SPEC.json OUT.json
        Only the reference texts, for adapter folders built elsewhere.
    python worker.py judge SPEC.json OUT.jsonl
        vLLM offline as the judge of adapters: one engine kept alive across adapters, a fresh
        one only when one dies; one JSON line of facts per adapter.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

WEIGHTS = "adapter_model.safetensors"


# ---- the base model ------------------------------------------------------------------------


def build_base(out: Path, model: dict[str, Any]) -> None:
    """A random Llama with a tokenizer of one token per byte, written like a Hub folder."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(model["seed"])
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=model["hidden_size"],
        intermediate_size=model["intermediate_size"],
        num_hidden_layers=model["num_hidden_layers"],
        num_attention_heads=model["num_attention_heads"],
        num_key_value_heads=model["num_key_value_heads"],
        head_dim=model["head_dim"],
        max_position_embeddings=model["max_position_embeddings"],
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    # Printable ASCII stands for itself; every other id is "<id>". 0-2 are unk, bos, eos.
    vocab = {(chr(i) if 32 <= i < 127 else f"<{i}>"): i for i in range(256)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<1>", eos_token="<2>", unk_token="<0>"
    ).save_pretrained(out)


def build_adapter(base: Path, out: Path, kind: dict[str, Any]) -> None:
    """A PEFT adapter saved by PEFT itself, with random (non-zero) A and B."""
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import LlamaForCausalLM

    torch.manual_seed(kind["seed"])
    model = LlamaForCausalLM.from_pretrained(base)
    config = LoraConfig(
        r=kind.get("r", 8),
        lora_alpha=kind.get("lora_alpha", 16),
        target_modules=kind["target_modules"],
        use_rslora=kind.get("use_rslora", False),
        rank_pattern=kind.get("rank_pattern", {}),
        alpha_pattern=kind.get("alpha_pattern", {}),
        lora_bias=kind.get("lora_bias", False),
        layers_to_transform=kind.get("layers_to_transform"),
        init_lora_weights=False,  # B random too: the adapter must change the text
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(out, safe_serialization=True)
    dtype = {"float32": torch.float32, "float16": torch.float16,
             "bfloat16": torch.bfloat16}[kind.get("dtype", "float32")]
    if dtype != torch.float32:
        path = out / WEIGHTS
        tensors = {name: t.to(dtype) for name, t in load_file(path).items()}
        save_file(tensors, path, metadata={"format": "pt"})
    for name, text in kind.get("extra_files", {}).items():
        (out / name).write_text(text)


# ---- reference texts ---------------------------------------------------------------------


def _base_model(base: Path) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(base).eval()


def reference(base: Path, adapter: Path | None, prompt: str, max_tokens: int,
              tokenizer: Any) -> dict[str, Any]:
    """The greedy text of base + adapter, computed by transformers + peft. `fits` is false when
    PEFT cannot apply every tensor of the file to this base model (a size mismatch, a tensor
    PEFT does not expect, a targeted module with no tensors) or the logits are not finite:
    then the adapter has no correct output on this base, and any text served for it is wrong."""
    import torch

    model = _base_model(base)
    if adapter is not None:
        try:
            model = _apply_adapter(model, adapter)
        except Exception as exc:  # what PEFT says is the verdict; any exception type
            return {"fits": False, "reason": f"peft: {type(exc).__name__}: {exc}"[:500],
                    "text": None}
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=2, pad_token_id=0,
            output_scores=True, return_dict_in_generate=True,
        )
    text = tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
    if not all(torch.isfinite(s).all() for s in out.scores):
        return {"fits": False, "reason": "the logits are not finite", "text": text}
    return {"fits": True, "reason": "", "text": text}


def _apply_adapter(model: Any, adapter: Path) -> Any:
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    config = LoraConfig.from_pretrained(adapter)
    if config.peft_type != "LORA" or json.loads(
            (adapter / "adapter_config.json").read_text()).get("peft_type") != "LORA":
        raise ValueError("not a LoRA adapter")
    model = get_peft_model(model, config)
    result = set_peft_model_state_dict(model, load_file(adapter / WEIGHTS))
    unexpected = list(result.unexpected_keys)

    def module(key: str) -> str:
        return key.split(".lora_")[0].rsplit(".", 1)[-1]

    # A module the file carries in some layers only is fine (PEFT keeps its initialisation in
    # the others); one the config targets and the file never carries is a lost part.
    carried = {module(k) for k in load_file(adapter / WEIGHTS)}
    missing = [k for k in result.missing_keys if ".lora_" in k and module(k) not in carried]
    if unexpected or missing:
        raise ValueError(f"tensors PEFT does not expect: {unexpected[:4]}; modules the config "
                         f"targets without tensors: {missing[:4]}")
    return model.eval()


def references(spec: dict[str, Any]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    base = Path(spec["base"])
    tokenizer = AutoTokenizer.from_pretrained(base)
    out: dict[str, Any] = {}
    for name, folder in spec["adapters"].items():
        out[name] = reference(base, Path(folder) if folder else None, spec["prompt"],
                              spec["max_tokens"], tokenizer)
    return out


def assets(spec: dict[str, Any], out: Path) -> None:
    base = out / "base"
    build_base(base, spec["model"])
    adapters: dict[str, str | None] = {"base": None}
    for name, kind in spec["peft_adapters"].items():
        build_adapter(base, out / "adapters" / name, kind)
        adapters[name] = str(out / "adapters" / name)
    texts = references({"base": str(base), "adapters": adapters, "prompt": spec["prompt"],
                        "max_tokens": spec["max_tokens"]})
    (out / "references.json").write_text(json.dumps(texts, indent=1, sort_keys=True))


# ---- vLLM as the judge ---------------------------------------------------------------------


class Judge:
    """One offline engine, replaced when it dies."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.llm: Any = None
        self.next_id = 1
        self.starts = 0

    def engine(self) -> Any:
        if self.llm is None:
            from vllm import LLM

            started = time.monotonic()
            self.llm = LLM(model=self.spec["base"], **self.spec["engine_args"])
            self.starts += 1
            print(f"judge: engine {self.starts} up in {time.monotonic() - started:.1f} s",
                  file=sys.stderr, flush=True)
        return self.llm

    def drop(self) -> None:
        """Forget a dead engine; its processes are ended before a new one starts."""
        llm, self.llm = self.llm, None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # a dead engine may fail to shut down; it is gone either way
                pass
            del llm
            import gc

            gc.collect()

    def request(self, name: str, path: str) -> Any:
        from vllm.lora.request import LoRARequest

        request = LoRARequest(name, self.next_id, path)
        self.next_id += 1
        return request

    def generate(self, lora: Any) -> str:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=self.spec["max_tokens"])
        outputs = self.engine().generate([self.spec["prompt"]], params, lora_request=lora,
                                         use_tqdm=False)
        return str(outputs[0].outputs[0].text)

    def control(self) -> str:
        control = self.spec["control"]
        return self.generate(self.request("control", control["path"]))

    def judge(self, name: str, path: str) -> dict[str, Any]:
        facts: dict[str, Any] = {"name": name, "refused": None, "killed": None, "text": None,
                                 "control_after": None}
        lora = self.request(name, path)
        # The engine's own loader and activation (the code the generate path runs inside the
        # engine step, where a failure kills the engine), called as a utility: it fails alone.
        try:
            self.engine().llm_engine.add_lora(lora)
        except Exception as exc:
            facts["refused"] = _message(exc)
            if not self._alive():
                facts["killed"] = facts["refused"]
            return facts
        try:
            facts["text"] = self.generate(lora)
        except Exception as exc:
            facts["killed"] = _message(exc)
            self.drop()
            return facts
        try:
            facts["control_after"] = self.control()
        except Exception as exc:
            facts["killed"] = "the next request (another adapter) failed: " + _message(exc)
            self.drop()
            return facts
        if facts["control_after"] != self.spec["control"]["text"]:
            # Damage that outlives one request must not leak into the next adapter's verdict.
            self.drop()
        return facts

    def _alive(self) -> bool:
        try:
            ok = self.control() == self.spec["control"]["text"]
        except Exception:
            ok = False
        if not ok:
            self.drop()
        return ok


def _message(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__ or exc.__context__
    if cause is not None:
        text += f" (from {type(cause).__name__}: {cause})"
    return text[:800]


def judge(spec: dict[str, Any], out: Path) -> None:
    started = time.monotonic()
    judge = Judge(spec)
    with out.open("w") as sink:
        first = judge.control()
        sink.write(json.dumps({"control_first": first}) + "\n")
        for case in spec["cases"]:
            t0 = time.monotonic()
            facts = judge.judge(case["name"], case["path"])
            facts["seconds"] = round(time.monotonic() - t0, 2)
            sink.write(json.dumps(facts) + "\n")
            sink.flush()
        sink.write(json.dumps({"engine_starts": judge.starts,
                               "seconds": round(time.monotonic() - started, 1)}) + "\n")
    judge.drop()


def main(argv: list[str]) -> int:
    command, spec_path, out = argv[0], Path(argv[1]), Path(argv[2])
    spec = json.loads(spec_path.read_text())
    try:
        if command == "assets":
            assets(spec, out)
        elif command == "references":
            out.write_text(json.dumps(references(spec), indent=1, sort_keys=True))
        elif command == "judge":
            judge(spec, out)
        else:
            print(f"unknown command {command!r}", file=sys.stderr)
            return 2
    except Exception:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.exit(main(sys.argv[1:]))
