"""convert_from_ortmodule: graphs in ORTModule's com.microsoft format run in ortbridge."""

import numpy as np
import onnx
import pytest
import torch
from conftest import session, value
from onnx import TensorProto as TP
from onnx import helper

import ortbridge


@ortbridge.register
class ScaleShift(torch.autograd.Function):
    """y = x * w * scale, z = x + shift; ORT's classic float / int constants."""

    @staticmethod
    def forward(ctx, x, w, scale, shift):
        ctx.save_for_backward(x, w)
        ctx.scale = scale
        return x * w * scale, x + shift

    @staticmethod
    def backward(ctx, gy, gz):
        x, w = ctx.saved_tensors
        gx = gy * w * ctx.scale + (gz if gz is not None else 0)
        return gx, gy * x * ctx.scale, None, None


FUNC = "test_convert.ScaleShift"


def ortmodule_graph(grad_inputs: list) -> onnx.ModelProto:
    """PythonOp + PythonOpGrad as ORTModule writes them: com.microsoft domain, no ortbridge
    extensions, an empty input name (or none at the end) for a gradient that does not flow."""
    fw = helper.make_node(
        "PythonOp",
        ["x", "w"],
        ["ctx", "y", "z"],
        domain="com.microsoft",
        name="ScaleShift_id_0",
        func_name=FUNC,
        input_convention="ddcc",
        input_requires_grads=[1, 1, 0, 0],
        input_tensor_types=[TP.FLOAT, TP.FLOAT],
        input_tensor_ranks=[1, 1],
        input_float_scalars=[0.5],
        input_float_scalar_positions=[2],
        input_int_scalars=[3],
        input_int_scalar_positions=[3],
        output_tensor_types=[TP.FLOAT, TP.FLOAT],
        output_tensor_ranks=[1, 1],
        training_mode=1,
        comment="exported by ORTModule",
    )
    bw = helper.make_node(
        "PythonOpGrad",
        ["ctx", *grad_inputs],
        ["gx", "gw"],
        domain="com.microsoft",
        name="ScaleShift_id_0_grad",
        func_name=FUNC,
        output_convention="ddcc",
        input_tensor_types=[TP.FLOAT, TP.FLOAT],
        input_tensor_ranks=[1, 1],
        output_tensor_types=[TP.FLOAT, TP.FLOAT],
        output_tensor_ranks=[1, 1],
        output_tensor_requires_grads=[1, 1],
    )
    feeds = sorted({"x", "w", *(g for g in grad_inputs if g)})
    graph = helper.make_graph(
        [fw, bw], "ortmodule", [value(n, shape=[4]) for n in feeds], [value(n) for n in ("y", "z", "gx", "gw")]
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


@pytest.mark.parametrize(
    "grad_inputs",
    [["gy", "gz"], ["gy", ""], ["gy"], ["", "gz"]],
    ids=["both", "empty-name", "left-off", "first-absent"],
)
def test_converted_graph_runs_forward_and_backward_like_torch(grad_inputs):
    original = ortmodule_graph(grad_inputs)
    converted = ortbridge.convert_from_ortmodule(original)
    assert original.graph.node[0].domain == "com.microsoft"  # the input is left as it was
    assert [n.domain for n in converted.graph.node] == ["ortbridge", "ortbridge"]
    assert {(o.domain, o.version) for o in converted.opset_import} == {("", 17), ("ortbridge", 1)}
    for before, after in zip(original.graph.node, converted.graph.node):
        kept = {a.name: a for a in after.attribute}
        assert all(kept[a.name] == a for a in before.attribute)  # every ORT attribute, unchanged

    x, w = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    gy, gz = torch.randn(4), torch.randn(4)
    y, z = ScaleShift.apply(x, w, 0.5, 3)
    # A gradient that does not flow reaches backward as zeros.
    flowing = [g if name in grad_inputs else torch.zeros(4) for g, name in ((gy, "gy"), (gz, "gz"))]
    gx, gw = torch.autograd.grad([y, z], [x, w], flowing)
    feeds = {"x": x.detach().numpy(), "w": w.detach().numpy(), "gy": gy.numpy(), "gz": gz.numpy()}
    sess = session(converted.SerializeToString())
    out = sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})
    for got, want in zip(out, [y, z, gx, gw]):
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-6, atol=1e-6)


def test_conversion_reads_paths_and_bytes(tmp_path):
    path = tmp_path / "ortmodule.onnx"
    onnx.save(ortmodule_graph(["gy", "gz"]), path)
    from_path = ortbridge.convert_from_ortmodule(path)
    assert from_path == ortbridge.convert_from_ortmodule(path.read_bytes())
    assert from_path == ortbridge.convert_from_ortmodule(str(path))


def test_nodes_inside_subgraphs_are_converted():
    inner = ortmodule_graph(["gy", "gz"])
    then_branch = helper.make_graph(list(inner.graph.node), "then", [], [value(n) for n in ("y", "z", "gx", "gw")])
    else_branch = helper.make_graph(
        [helper.make_node("Identity", [n], [f"{n}_else"]) for n in ("x", "w", "gy", "gz")],
        "else",
        [],
        [value(f"{n}_else") for n in ("x", "w", "gy", "gz")],
    )
    node = helper.make_node("If", ["flag"], ["y", "z", "gx", "gw"], then_branch=then_branch, else_branch=else_branch)
    graph = helper.make_graph(
        [node],
        "outer",
        [value("flag", TP.BOOL, [])] + [value(n, shape=[4]) for n in ("x", "w", "gy", "gz")],
        [value(n) for n in ("y", "z", "gx", "gw")],
    )
    model = helper.make_model(graph, opset_imports=inner.opset_import, ir_version=8)
    converted = ortbridge.convert_from_ortmodule(model)
    branch = next(a.g for a in converted.graph.node[0].attribute if a.name == "then_branch")
    assert [n.domain for n in branch.node] == ["ortbridge", "ortbridge"]
    x, w, gy, gz = (np.random.rand(4).astype(np.float32) for _ in range(4))
    y, z, gx, gw = session(converted.SerializeToString()).run(
        None, {"flag": np.array(True), "x": x, "w": w, "gy": gy, "gz": gz}
    )
    np.testing.assert_allclose(y, x * w * 0.5, rtol=1e-6)
    np.testing.assert_allclose(gx, gy * w * 0.5 + gz, rtol=1e-6)


def test_nodes_inside_model_local_functions_are_converted():
    model = ortmodule_graph(["gy", "gz"])
    fw = model.graph.node[0]
    model.functions.append(
        helper.make_function(
            "local", "Forward", ["x", "w"], ["ctx", "y", "z"], [fw], opset_imports=list(model.opset_import)
        )
    )
    converted = ortbridge.convert_from_ortmodule(model)
    assert [n.domain for n in converted.functions[0].node] == ["ortbridge"]
    assert {o.domain for o in converted.functions[0].opset_import} == {"", "ortbridge"}
    assert [n.domain for n in model.functions[0].node] == ["com.microsoft"]


def test_other_com_microsoft_nodes_keep_their_domain():
    model = ortmodule_graph(["gy", "gz"])
    model.graph.node.append(helper.make_node("Gelu", ["y"], ["g"], domain="com.microsoft"))
    model.graph.output.append(value("g"))
    converted = ortbridge.convert_from_ortmodule(model)
    assert [n.domain for n in converted.graph.node] == ["ortbridge", "ortbridge", "com.microsoft"]
    assert {o.domain for o in converted.opset_import} == {"", "com.microsoft", "ortbridge"}


def test_python_objects_by_address_are_refused_with_what_to_do():
    model = ortmodule_graph(["gy", "gz"])
    fw = model.graph.node[0]
    fw.attribute.extend(
        [
            helper.make_attribute("input_pointer_scalars", [140234567]),
            helper.make_attribute("input_pointer_scalar_positions", [3]),
        ]
    )
    with pytest.raises(
        ValueError,
        match=r"ScaleShift_id_0.*by their address.*Re-export the model with "
        r"ortbridge.export",
    ):
        ortbridge.convert_from_ortmodule(model)


def test_rejects_what_is_not_a_model():
    with pytest.raises(TypeError, match="takes a ModelProto, bytes or a path"):
        ortbridge.convert_from_ortmodule(42)
