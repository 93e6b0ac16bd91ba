"""labkit.docs: every exported name has a docstring, docs/api.md is current, and the generator on a made-up package."""

import sys
import textwrap

import pytest

from labkit.docs import API_PAGE, REGENERATE, example, first_paragraph, render_api_page, signature, undocumented


def test_every_exported_name_has_a_docstring():
    missing = undocumented()
    assert not missing, (f"exported names without a docstring: {missing}; give each one (a constant: a string "
                         f"literal on the line after its assignment), then run `{REGENERATE}`")


def test_api_page_is_current():
    assert API_PAGE.exists(), f"{API_PAGE} is missing: run `{REGENERATE}`"
    assert API_PAGE.read_text() == render_api_page(), f"docs/api.md is out of date: run `{REGENERATE}` and commit it"


FAKE = {
    "__init__.py": '''
        """A made-up package for the API page's tests.

        More about it, not on the page.

            from fakedocs import f
            f(1, 2)
        """
        from fakedocs.sub import LIMIT, C, Plain, f, undocumented_fn

        __all__ = ["f", "C", "Plain", "LIMIT", "undocumented_fn", "not_defined", "noall"]
        ''',
    "sub.py": '''
        from dataclasses import dataclass

        LIMIT = {"a": 1}
        """The limit of each thing,
        by name."""


        def f(x: "torch.Tensor", y: int = 2, *, mode: str = "a, b") -> "torch.Tensor":
            """Add ``y`` to ``x``: float32, shape [n].

            Details not on the page.
            """
            return x + y


        class C:
            """A thing."""

            def __init__(self, n: int):
                self.n = n


        @dataclass
        class Plain:
            n: int


        def undocumented_fn():
            pass
        ''',
    "noall.py": '"""A module that exports nothing."""\n',
    "broken.py": "import fakedocs_dependency_that_is_not_installed\n",
}


@pytest.fixture
def fake(tmp_path, monkeypatch):
    pkg = tmp_path / "fakedocs"
    pkg.mkdir()
    for name, text in FAKE.items():
        (pkg / name).write_text(textwrap.dedent(text).lstrip())
    monkeypatch.syspath_prepend(str(tmp_path))
    yield ("fakedocs", "fakedocs.noall", "fakedocs_does_not_exist")
    for name in [m for m in sys.modules if m.startswith("fakedocs")]:
        del sys.modules[name]


def test_page_of_a_made_up_package(fake):
    page = render_api_page(fake)
    assert "A made-up package for the API page's tests." in page and "More about it" not in page
    assert "```python\nfrom fakedocs import f\nf(1, 2)\n```" in page
    assert "f(x: torch.Tensor, y: int = 2, *, mode: str = 'a, b') -> torch.Tensor" in page
    assert "Add ``y`` to ``x``: float32, shape [n]." in page and "Details not on the page" not in page
    assert "class C(n: int)\n" in page and "A thing." in page
    assert "LIMIT: dict" in page and "The limit of each thing, by name." in page
    assert "`fakedocs.noall` exports nothing yet" in page
    assert "module fakedocs.noall" in page and "A module that exports nothing." in page  # a submodule in __all__
    assert "`fakedocs_does_not_exist` does not exist yet." in page
    # a dataclass's generated __doc__ and a name missing from the module are not documentation
    assert undocumented(fake) == ["fakedocs.Plain (no docstring)", "fakedocs.undocumented_fn (no docstring)",
                                  "fakedocs.not_defined (in __all__ but not defined)"]


def test_an_import_error_inside_a_package_is_raised_not_skipped(fake):
    with pytest.raises(ModuleNotFoundError, match="fakedocs_dependency_that_is_not_installed"):
        render_api_page(("fakedocs.broken",))


def test_example_is_the_first_fenced_or_indented_block():
    fenced = "Title.\n\n```bash\npython -m labkit docs\n```\n\n    x = 1\n"
    assert example(fenced) == ("bash", "python -m labkit docs")
    indented = "Title.\n\n    python -m labkit run\n    python -m labkit readme\n\nAfter.\n\n```python\ny = 2\n```"
    assert example(indented) == ("bash", "python -m labkit run\npython -m labkit readme")
    assert example("Title.\n\n* a bullet\n    continued, not code\n") is None
    assert first_paragraph("Title\n    continues.\n\nNext.") == "Title continues."


def test_long_signatures_put_one_parameter_a_line():
    def g(name: str = "a, (b", sizes: tuple = (1, 2), *rest, flag: bool = False, **options) -> dict:
        """G."""

    name = "a_function_with_a_long_name"
    assert signature(g, name).splitlines() == [name + "(", "    name: str = 'a, (b',", "    sizes: tuple = (1, 2),",
                                              "    *rest,", "    flag: bool = False,", "    **options,", ") -> dict"]
