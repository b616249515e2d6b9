"""hf_tpu's kernel forms registry (hf_tpu.kernels.forms): every built-in choice registered, measured or marked
unmeasured, its measured table naming only its forms, and the one lookup following each override."""

from __future__ import annotations

import pytest

from hf_tpu import _env
from hf_tpu.errors import InvalidArgumentError
from hf_tpu.kernels import experts_forms
from hf_tpu.kernels.forms import BUILTIN, KernelForm, choose_form, kernel_form, kernel_forms


def test_every_built_in_form_is_registered_and_measured_or_marked_unmeasured():
    forms = {form.name: form for form in kernel_forms()}
    assert set(BUILTIN) <= set(forms), sorted(set(BUILTIN) - set(forms))
    for form in forms.values():
        assert (form.table is None) != (not form.unmeasured), form.name
        assert set(form.usable()) <= set(form.forms), form.name
        if form.table is not None:  # the table measures the form's own forms only, each somewhere
            measured = {f for row in form.table()["rows"] for f, s in row["seconds"].items() if s is not None}
            assert measured and measured <= set(form.forms), (form.name, sorted(measured - set(form.forms)))


def test_a_form_needs_a_table_or_a_reason():
    with pytest.raises(InvalidArgumentError, match="unmeasured="):
        KernelForm("test_op", ("a",), "a test's", pick=lambda override: "a")
    with pytest.raises(InvalidArgumentError, match="pick"):
        KernelForm("test_op", ("a",), "a test's", unmeasured="a test's")


@pytest.mark.parametrize("name", ["decode_attention", "kv_write", "kv_rows_writer"])
def test_an_unmeasured_form_is_its_variables_choice(name, monkeypatch):
    var = kernel_form(name).override
    for value in var.choices:
        monkeypatch.setenv(var.name, value)
        assert choose_form(name) == var.get() == value


def test_the_experts_choice_is_the_measured_tables(monkeypatch):
    shape = {"hidden": 2048, "intermediate": 768, "experts": 128, "top_k": 8}
    for tokens in (1, 8, 512):
        for forms in (experts_forms.DEFAULT_FORMS, experts_forms.FORMS):
            want = experts_forms.choose(**shape, tokens=tokens, forms=forms)
            assert choose_form("experts", **shape, tokens=tokens, forms=forms) == want
    monkeypatch.setenv(_env.MEASURED_EXPERTS.name, "torch")
    assert experts_forms.measured_name() == experts_forms.MEASURED_NAME
