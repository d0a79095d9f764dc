"""Makes tests/fixtures/chat/kestrel_chat.json: the prompts kestrel 0.9.2's own chat skill
(`MoondreamChatSkill`, Moondream's engine) renders for a set of conversations, per model
family and with reasoning off and on, and the messages it refuses.  tests/test_chat.py
renders the same conversations with photon_jax and compares them token for token.

kestrel is a CUDA engine; its chat rendering is plain Python, but importing it pulls torch and
its native kernels.  Those imports are stubbed here with inert placeholders (never called by
the rendering path), so the owner's code runs unchanged on a CPU without torch.

    pip download kestrel==0.9.2 --no-deps && unzip kestrel-0.9.2-*.whl -d KESTREL_DIR
    python tests/kestrel_chat_golden.py KESTREL_DIR tests/fixtures/chat/tokenizer.json \
        tests/fixtures/chat/kestrel_chat.json
"""

import importlib.abc
import importlib.machinery
import json
import sys
import types

sys.path.insert(0, sys.argv[1])


class _Meta(type):
    """A placeholder class: any attribute, call, subscript or union is a placeholder again,
    and a decorator call hands the decorated function back."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Dummy

    def __call__(cls, *a, **k):
        if len(a) == 1 and callable(a[0]) and not k:
            return a[0]
        return _Dummy

    def __getitem__(cls, k):
        return _Dummy

    def __or__(cls, o):
        return _Dummy

    def __ror__(cls, o):
        return _Dummy


class _Dummy(metaclass=_Meta):
    pass


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Dummy


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    ROOTS = ("torch", "kestrel_native", "httpx", "pyvips", "huggingface_hub", "safetensors",
             "aiohttp", "requests", "kornia", "cv2", "scipy", "triton", "flashinfer",
             "einops", "kestrel_kernels", "cuda")

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.ROOTS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        m = _Stub(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, m):
        pass


sys.meta_path.insert(0, _StubFinder())

import base64
from copy import deepcopy
from kestrel.models.moondream.config import (MoondreamConfig, DEFAULT_MOONDREAM2_CONFIG,
                                              DEFAULT_MOONDREAM3_CONFIG)
from kestrel.runtime.tokens import ImageMarker, TextToken
from kestrel.skills import chat as chat_mod
from tokenizers import Tokenizer

chat_mod.load_image_bytes_from_base64 = lambda v: base64.b64decode(v.split(",", 1)[1])
TOK = sys.argv[2]
tok = Tokenizer.from_file(TOK)
IMG = "data:image/png;base64," + base64.b64encode(b"img").decode()
def img(): return {"type": "image_url", "image_url": {"url": IMG}}
CASES = {
  "one_turn_text": [{"role": "user", "content": "What is this?"}],
  "one_turn_image": [{"role": "user", "content": [img(), {"type": "text", "text": "Describe it."}]}],
  "image_after_text_part": [{"role": "user", "content": [{"type": "text", "text": "Look: "}, img(), {"type": "text", "text": "what colour?"}]}],
  "system_first": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": [img(), {"type": "text", "text": "How many cats?"}]}],
  "system_empty_user_image_only": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": [img()]}],
  "three_turns": [{"role": "system", "content": "You are helpful."},
                  {"role": "user", "content": [img(), {"type": "text", "text": "What animal?"}]},
                  {"role": "assistant", "content": "A cat."},
                  {"role": "user", "content": "What colour is it?"},
                  {"role": "assistant", "content": [{"type": "text", "text": "Black"}, {"type": "text", "text": " and white."}]},
                  {"role": "user", "content": "Is it asleep?"}],
  "stray_assistant_first": [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Hi there"}],
  "two_users_in_a_row": [{"role": "user", "content": "first"}, {"role": "user", "content": "second"}],
  "second_image_later": [{"role": "user", "content": [img(), {"type": "text", "text": "a"}]}, {"role": "assistant", "content": "b"}, {"role": "user", "content": [img(), {"type": "text", "text": "c"}]}],
  "three_images_three_turns": [{"role": "system", "content": "s"}, {"role": "user", "content": [img(), img(), {"type": "text", "text": "a"}]}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}, {"role": "user", "content": [img(), {"type": "text", "text": "e"}]}],
  "image_after_a_text_turn": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": [img(), {"type": "text", "text": "c"}]}],
  "none_content_assistant": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": None}, {"role": "user", "content": "q2"}],
}
ERRORS = {
  "system_not_first": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
  "last_assistant": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
  "image_in_assistant": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [img()]}, {"role": "user", "content": "c"}],
  "image_in_system": [{"role": "system", "content": [img()]}, {"role": "user", "content": "c"}],
  "bad_role": [{"role": "tool", "content": "a"}],
  "empty_last": [{"role": "user", "content": ""}],
  "empty": [],
}
skill = chat_mod.ChatSkill  # for build_request
from kestrel.models.moondream.skills.chat import MoondreamChatSkill
out = {"tokenizer": "tests/fixtures/chat/tokenizer.json", "kestrel": "0.9.2", "families": {}}
for fam, d in (("moondream2", DEFAULT_MOONDREAM2_CONFIG), ("moondream3", DEFAULT_MOONDREAM3_CONFIG)):
    cfg = MoondreamConfig.from_dict(deepcopy(d))
    rt = types.SimpleNamespace(prompt_template=cfg.tokenizer, tokenizer=tok)
    sk = MoondreamChatSkill()
    res = {}
    for name, msgs in CASES.items():
        for reasoning in (False, True):
            built = sk.build_request(None, {"messages": msgs, "reasoning": reasoning}, None)
            toks = sk.build_prompt_tokens(rt, built.request_context)
            seq = ["image" if isinstance(t, ImageMarker) else t.token_id for t in toks]
            res[f"{name}/{'reasoning' if reasoning else 'answer'}"] = seq
    errs = {}
    for name, msgs in ERRORS.items():
        try:
            built = sk.build_request(None, {"messages": msgs}, None)
            sk.build_prompt_tokens(rt, built.request_context)
            errs[name] = None
        except ValueError as e:
            errs[name] = str(e)
    out["families"][fam] = {"prompts": res, "errors": errs}
    b = sk.build_request(None, {"messages": CASES["one_turn_text"]}, None)
    out["families"][fam]["default_reasoning"] = b.request_context.reasoning
out["cases"] = CASES; out["error_cases"] = ERRORS
json.dump(out, open(sys.argv[3], "w"), indent=1)
print("wrote", sys.argv[3])
