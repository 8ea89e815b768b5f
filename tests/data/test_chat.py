"""Chat data: rendering with the tokenizer's own template, the assistant mask, and every refusal.

The tokenizer is a small byte-level BPE trained here with ChatML's `<|im_start|>`/`<|im_end|>` as
special tokens; each template below is a few lines of jinja written to exercise one path."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from dropless.data import chat  # noqa: E402
from dropless.data.chat import ChatTemplate, is_chat_jsonl, read_chat  # noqa: E402
from dropless.data.tokenizer import HFTokenizer  # noqa: E402

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# ChatML with the replies declared by {% generation %}; the "\n" after <|im_end|> stays outside.
GENERATION = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
              "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}"
              "{% endgeneration %}{{ '\\n' }}{% else %}{{ m['content'] + '<|im_end|>\\n' }}{% endif %}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Llama-2 style strictness, and a role ('developer') that only this template names.
STRICT = ("{% for m in messages %}{% if m['role'] == 'user' and loop.index0 > 0 and "
          "messages[loop.index0 - 1]['role'] == 'user' %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
          "{% endif %}{% if m['role'] == 'developer' %}{{ '<|im_start|>system\\n' }}"
          "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% endif %}{{ m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Drops every assistant reply but the last, as templates that strip earlier reasoning do.
REWRITES = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
            "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}{{ '<|im_end|>\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# A plain-text layout whose generation prompt ends in a space that the reply's first word absorbs.
MERGES = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "Hi. How are you?"},
    {"role": "user", "content": "fine, thanks"},
    {"role": "assistant", "content": "Good to hear.\nBye"},
]


def tokenizer_folder(folder: Path, template: str | None, jinja_file: bool = False) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder.mkdir(parents=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([json.dumps(CONVERSATION), "system user assistant tool"] * 20, trainer)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<s>"])
    # a BOS post-processor, as Llama's tokenizer.json has: encoding with add_special_tokens=True would
    # put a <s> the template never wrote in front of every render
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None and jinja_file:
        (folder / "chat_template.jinja").write_text(template)
    elif template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tok")
    named = {"chatml": CHATML, "generation": GENERATION, "strict": STRICT, "rewrites": REWRITES,
             "merges": MERGES, "none": None}
    out = {name: tokenizer_folder(root / name, t) for name, t in named.items()}
    out["jinja"] = tokenizer_folder(root / "jinja", CHATML, jinja_file=True)
    return out


@pytest.fixture(scope="module")
def chatml(folders: dict[str, Path]) -> ChatTemplate:
    return ChatTemplate(folders["chatml"] / "tokenizer.json")


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def runs(loss: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of ones."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], loss.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def test_mask_is_each_reply_and_its_end_of_turn(chatml: ChatTemplate, folders: dict[str, Path]) -> None:
    ids, loss = chatml.render(CONVERSATION, "x.jsonl line 1")
    assert ids.dtype == np.int64 and loss.dtype == np.uint8 and ids.shape == loss.shape
    hf = HFTokenizer(folders["chatml"])
    replies = [hf.decode(ids[a:b].tolist()) for a, b in runs(loss)]
    assert replies == ["Hi. How are you?<|im_end|>", "Good to hear.\nBye<|im_end|>"]
    # the ids are the pipeline tokenizer's own encoding of the template's text, headers unmasked
    text = hf.decode(ids.tolist())
    assert text == chatml._tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert ids.tolist() == hf.encode(text)
    out = chatml._tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)
    assert ids.tolist() == out["input_ids"]
    assert hf.decode(ids[loss == 0].tolist()).count("<|im_start|>assistant\n") == 2


def test_generation_blocks_agree_with_prefix_rendering(folders: dict[str, Path]) -> None:
    gen = ChatTemplate(folders["generation"])
    assert gen.method == "generation"
    ids, loss = gen.render(CONVERSATION, "x.jsonl line 1")
    prefix_ids, prefix_loss = gen._prefix_mask(CONVERSATION, "x.jsonl line 1")
    assert ids.tolist() == prefix_ids and loss.tolist() == prefix_loss.tolist() and loss.sum() > 0


def test_read_chat_names_lines_and_skips_blanks(chatml: ChatTemplate, tmp_path: Path) -> None:
    short = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hi"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}, "  ", {"messages": short}])
    examples = read_chat(path, chatml)
    assert [e.name for e in examples] == ["chat.jsonl:1", "chat.jsonl:3"]
    assert examples[0].ids.tolist() == chatml.render(CONVERSATION, "")[0].tolist()
    assert all(e.ids.dtype == np.int64 and e.loss.dtype == np.uint8 for e in examples)


def test_template_from_jinja_file_and_identity(folders: dict[str, Path], chatml: ChatTemplate) -> None:
    from_jinja = ChatTemplate(folders["jinja"])
    assert from_jinja.identity == chatml.identity
    assert from_jinja.render(CONVERSATION, "")[1].tolist() == chatml.render(CONVERSATION, "")[1].tolist()
    assert ChatTemplate(folders["generation"]).identity != chatml.identity


def test_is_chat_jsonl(tmp_path: Path) -> None:
    assert is_chat_jsonl(write_jsonl(tmp_path / "a.jsonl", ["", {"messages": []}]))
    assert not is_chat_jsonl(write_jsonl(tmp_path / "b.jsonl", [{"text": "x"}]))
    assert is_chat_jsonl(tmp_path / "b.jsonl", field="text")
    assert not is_chat_jsonl(write_jsonl(tmp_path / "c.txt", [{"messages": []}]))
    assert not is_chat_jsonl(write_jsonl(tmp_path / "d.jsonl", ["{not json"]))
    assert not is_chat_jsonl(write_jsonl(tmp_path / "e.jsonl", ["[1, 2]"]))
    assert not is_chat_jsonl(tmp_path / "missing.jsonl")


U, A = {"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hi"}
REFUSALS = [
    ("{not json", "invalid JSON"),
    ({"text": "hello"}, "no 'messages' field"),
    ({"messages": "hello"}, "non-empty list of objects"),
    ({"messages": []}, "non-empty list of objects"),
    ({"messages": [U, "hi"]}, "message 1 is str, expected an object"),
    ({"messages": [{"content": "hello"}, A]}, "message 0 'role' is missing"),
    ({"messages": [U, {"role": "assistant", "content": None}]}, "message 1 'content' is NoneType"),
    ({"messages": [U, {"role": "assitant", "content": "Hi"}, A]}, "role 'assitant' is not one"),
    ({"messages": [U, U]}, "no assistant message"),
    ({"messages": [A, U, A]}, "message 0 is an assistant message"),
]


@pytest.mark.parametrize("line,expect", REFUSALS, ids=[e for _, e in REFUSALS])
def test_refusals_name_file_and_line(chatml: ChatTemplate, tmp_path: Path, line: object, expect: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [U, A]}, "", line])
    with pytest.raises(ValueError, match=f"{str(path)!r} line 3: .*{expect}") as err:
        read_chat(path, chatml)
    assert expect in str(err.value)


def test_template_errors_and_named_roles(folders: dict[str, Path], tmp_path: Path) -> None:
    strict = ChatTemplate(folders["strict"])
    dev = {"role": "developer", "content": "be brief"}
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [dev, U, A]}, {"messages": [U, U, A]}])
    with pytest.raises(ValueError, match=r"line 2: the chat template refuses .*TemplateError: "
                                         "Conversation roles must alternate"):
        read_chat(path, strict)
    assert strict.render([dev, U, A], "")[1].sum() > 0  # 'developer' is named by this template only
    with pytest.raises(ValueError, match="role 'developer' is not one"):
        ChatTemplate(folders["chatml"]).render([dev, U, A], "c.jsonl line 1")


def test_template_that_rewrites_earlier_turns_is_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "r.jsonl", [{"messages": [U, A]}, {"messages": CONVERSATION}])
    with pytest.raises(ValueError, match=r"r.jsonl' line 2: the chat template rewrites earlier turns: "
                                         "the conversation rendered through assistant message 2"):
        read_chat(path, ChatTemplate(folders["rewrites"]))


def test_tokens_merged_across_the_reply_boundary_are_refused(folders: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="x.jsonl line 4: the tokenizer merges tokens across the boundary "
                                         "up to assistant message 1"):
        # " are" is one token (trained on "How are you?"), the prompt alone ends in a lone " "
        ChatTemplate(folders["merges"]).render([U, {"role": "assistant", "content": "are you"}],
                                               "x.jsonl line 4")


def test_tokenizer_folders_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"{str(folders['none'])!r} has no chat template"):
        ChatTemplate(folders["none"] / "tokenizer.json")
    with pytest.raises(ValueError, match="no tokenizer.json in"):
        ChatTemplate(tmp_path)


def test_overlong_refused_or_truncated(chatml: ChatTemplate, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "o.jsonl", [{"messages": CONVERSATION}])
    full = read_chat(path, chatml)[0]
    n = len(full.ids)
    assert read_chat(path, chatml, max_tokens=n)[0].ids.tolist() == full.ids.tolist()
    with pytest.raises(ValueError, match=f"o.jsonl' line 1: {n} tokens, more than the limit of {n - 1} "
                                         r"\(train.seq_len \+ 1\); set data.overlong=truncate"):
        read_chat(path, chatml, max_tokens=n - 1)
    cut = read_chat(path, chatml, max_tokens=n - 3, overlong="truncate")[0]
    assert cut.ids.tolist() == full.ids[:n - 3].tolist() and cut.loss.tolist() == full.loss[:n - 3].tolist()
    first = int(np.flatnonzero(full.loss)[0])
    with pytest.raises(ValueError, match=f"line 1: truncated to {first} tokens it keeps no assistant token"):
        read_chat(path, chatml, max_tokens=first, overlong="truncate")
    with pytest.raises(ValueError, match="data.overlong='drop'"):
        read_chat(path, chatml, overlong="drop")


def test_missing_transformers_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install 'dropless\[hf\]'"):
        chat._import_transformers()
