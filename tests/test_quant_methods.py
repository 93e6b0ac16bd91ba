import pytest
import torch

from labkit.quant import METHODS, quantize, target_linears
from labkit.quant.fp8 import Fp8Linear
from labkit.quant.weight_only import Int4Linear, Int8Linear

EXPECTED = {"int8": Int8Linear, "int4": Int4Linear, "gptq": Int4Linear, "fp8": Fp8Linear,
            "bnb-int8": "Linear8bitLt", "bnb-nf4": "Linear4bit"}
PROMPT = "The os module provides"


def _calib(model, n=2, seq=32):
    return torch.randint(3, model.config.vocab_size, (n, seq), generator=torch.Generator().manual_seed(0))


def _options(method, model):
    return {"calib": _calib(model)} if method == "gptq" else {}


def _greedy(model, tok, n=8):
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("method", METHODS)
def test_quantised_model_generates(tiny_model, method):
    if method.startswith("bnb"):
        pytest.importorskip("bitsandbytes")
    model, tok = tiny_model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    qmodel = quantize(model, method, **_options(method, model))
    kinds = {type(m) if not isinstance(EXPECTED[method], str) else type(m).__name__
             for n, m in qmodel.named_modules() if n in target_linears(model)}
    assert kinds == {EXPECTED[method]}
    assert type(qmodel.lm_head).__name__ == "Linear" and qmodel.labkit_quant["method"] == method
    tokens = _greedy(qmodel, tok)
    assert len(tokens) == 8
    # the input model is untouched (inplace=False) and still plain
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(type(m).__name__ == "Linear" for m in target_linears(model).values())
    if method == "int8":  # int8 weights barely move the logits: same greedy tokens as float32
        assert tokens == _greedy(model, tok)


def test_copy_shares_only_replaced_weights(tiny_model):
    model, _ = tiny_model
    qmodel = quantize(model, "int8")
    assert qmodel.model.embed_tokens.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert qmodel.lm_head.weight is qmodel.model.embed_tokens.weight  # tie kept when the head stays float


def test_lm_head_unties_the_embedding(tiny_model):
    model, tok = tiny_model
    qmodel = quantize(model, "int4", lm_head=True)
    assert isinstance(qmodel.lm_head, Int4Linear) and not qmodel.config.tie_word_embeddings
    assert torch.equal(qmodel.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert model.config.tie_word_embeddings and type(model.lm_head).__name__ == "Linear"
    assert len(_greedy(qmodel, tok, n=4)) == 4


def test_lm_head_by_another_method(tiny_model):
    """``lm_head="int8"``: int4 layers, an int8 head (untied from the embedding), and generation still runs; the
    head's error is int8's, not int4's."""
    from labkit.evaluate import relative_error

    model, tok = tiny_model
    qmodel = quantize(model, "int4", lm_head="int8")
    assert isinstance(qmodel.lm_head, Int8Linear) and not qmodel.config.tie_word_embeddings
    assert isinstance(qmodel.model.layers[0].mlp.down_proj, Int4Linear)
    assert qmodel.labkit_quant["lm_head"] == "int8"
    int4_head = quantize(model, "int4", lm_head=True).lm_head
    x = torch.randn(3, model.config.hidden_size)
    ref = model.lm_head(x)
    assert relative_error(qmodel.lm_head(x), ref) < relative_error(int4_head(x), ref) / 2
    assert len(_greedy(qmodel, tok, n=4)) == 4
    with pytest.raises(ValueError, match=r"lm_head='nf4': allowed False, True"):
        quantize(model, "int4", lm_head="nf4")


def test_inplace_modifies_the_model(tiny_model):
    import copy

    model = copy.deepcopy(tiny_model[0])
    out = quantize(model, "fp8", inplace=True)
    assert out is model and isinstance(model.model.layers[0].mlp.down_proj, Fp8Linear)


@pytest.mark.parametrize("method,options,match", [
    ("int3", {}, r"method='int3' is unknown; allowed: \['int8'"),
    ("int8", {"group_size": 64}, r"do not apply to method='int8'"),
    ("int4", {"group_size": 96}, r"group_size=96 does not divide in_features=256"),
    ("gptq", {}, "needs calibration text"),
    ("gptq", {"tokenizer": "tok", "calib_split": "heldout"}, "calib_split='heldout'"),
    ("bnb-int8", {"threshold": -1.0}, "threshold"),
    ("int4", {"group_size": 64.0}, "group_size=64.0 must be an int"),
    ("int4", {"group_size": -64}, "group_size=-64 must be an int >= 1"),
    ("bnb-nf4", {"double_quant": "yes"}, "double_quant='yes' must be True or False"),
    ("int8", {"inplace": 1}, "inplace=1 must be True or False"),
])
def test_bad_input(tiny_model, method, options, match):
    with pytest.raises(ValueError, match=match):
        quantize(tiny_model[0], method, **options)


def test_wrong_types_are_refused(tiny_model):
    with pytest.raises(TypeError, match="model must be a torch nn.Module with parameters.*got str"):
        quantize("int8", "int8")  # used to raise AttributeError
    with pytest.raises(TypeError, match=r"method=8 must be a str, one of \['int8'"):
        quantize(tiny_model[0], 8)
    with pytest.raises(ValueError, match="method='INT8' is unknown"):
        quantize(tiny_model[0], "INT8")


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_cuda_quantised_model_generates(method):
    from labkit.model import load_model

    model, tok = load_model(device="cuda", dtype=torch.bfloat16)
    qmodel = quantize(model, method)
    assert len(_greedy(qmodel.cuda(), tok)) == 8


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_labkit_model_layers_swapped_by_name_and_served(tiny_model, method):
    """``quantize`` on labkit's own decoder swaps each layer's qkv_proj, o_proj, gate_up_proj and down_proj (and
    the LM head by ``lm_head=``, untying it in a frozen config); the engine serves it, the epilogue fusions on, with
    the greedy tokens of the HF model quantised the same way (the same weights: RTN is row-wise)."""
    from labkit.data import EMBEDDED_MODEL_DIR
    from labkit.engine import LLMEngine, SamplingParams
    from labkit.model import load_checkpoint

    ours = load_checkpoint(EMBEDDED_MODEL_DIR, dtype=torch.float32)
    qours = quantize(ours, method, lm_head="int8")
    swapped = {n.rsplit(".", 1)[-1] for n, m in qours.named_modules() if isinstance(m, (Int8Linear, Int4Linear))}
    assert swapped == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    assert not qours.config.tie_word_embeddings and ours.config.tie_word_embeddings  # the input is untouched
    prompt = tiny_model[1](PROMPT).input_ids
    outs = {}
    for name, m in (("ours", qours), ("hf", quantize(tiny_model[0], method, lm_head="int8"))):
        engine = LLMEngine(m, kernels="triton", num_blocks=16, block_size=8, max_num_seqs=1, cuda_graphs=False)
        assert not engine.runner.plan.quant_epilogues  # 'auto' backend: torch matmuls on the CPU, no epilogues
        outs[name] = engine.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True),
                                     progress=False)[0].output_token_ids
    assert outs["ours"] == outs["hf"] and len(outs["ours"]) == 3
