"""Config sections and the registries that turn them into radbo's interchangeable parts.

A run config (``radbo run CONFIG.toml``) has sections whose kind is chosen by a tag:
``[algorithm] name = "rabo"``, ``[estimator] name = "cg"``, ``[data] name = "digits"``, ... Each
kind is a :class:`Section` -- a strict, frozen pydantic model whose fields are the kind's
settings, declared once, with their defaults, bounds and descriptions -- registered in the
:class:`Registry` of its section. The registry builds the section's tagged union, so that
validation picks the class from the tag and reports errors under the section's name, and the
registered class says how it becomes the object radbo runs (its ``build`` method).

Adding a kind therefore needs its file and one decorator, nothing else:

>>> from typing import Annotated, Literal
>>> from pydantic import Field
>>> SHAPES = Registry("shape", "kind")
>>> @SHAPES.register
... class Square(Section):
...     kind: Literal["square"] = "square"
...     side: float = Field(1.0, gt=0)
>>> class Drawing(Section):
...     shape: Annotated[Section, SHAPES] = Field(default_factory=Square)
>>> SHAPES.attach(Drawing)
>>> Drawing.model_validate({"shape": {"kind": "square", "side": 2}}).shape.side
2.0
>>> @SHAPES.register                        # registered later: the union grows
... class Circle(Section):
...     kind: Literal["circle"]
...     radius: float = 1.0
>>> Drawing.model_validate({"shape": {"kind": "circle"}}).shape
Circle(kind='circle', radius=1.0)
"""

from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Generic, Literal, TypeVar, cast, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    GetCoreSchemaHandler,
    SerializerFunctionWrapHandler,
    model_serializer,
)
from pydantic_core import CoreSchema, core_schema

__all__ = ["ConfigError", "Named", "Registry", "Section", "all_tags", "registries"]


class ConfigError(ValueError):
    """A configuration is missing, unreadable or invalid; the message is user-facing."""


class Section(BaseModel):
    """A strict config section: unknown keys are errors, instances are immutable.

    ``dump_omits_defaults`` names fields added after configs were first stored: a dump leaves
    each out while it holds its default, so configs without it dump (in ``results.json`` and
    checkpoints) as they did before it existed, and resuming them still compares equal."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    dump_omits_defaults: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_defaults(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            fields = type(self).model_fields
            for name in self.dump_omits_defaults:
                if getattr(self, name) == fields[name].get_default(call_default_factory=True):
                    data.pop(name, None)
        return data


S = TypeVar("S", bound=Section)
_REGISTRIES: list["Registry[Any]"] = []


class Registry(Generic[S]):
    """The registered kinds of one config section, keyed by the value of a tag field.

    Args:
        section: the section's name in a run config (``"algorithm"``), used in messages.
        key: the tag field every kind declares as a ``Literal`` (``"name"``, ``"kind"``).
    """

    def __init__(self, section: str, key: str) -> None:
        self.section = section
        self.key = key
        self._classes: dict[str, type[S]] = {}
        self._dependents: list[type[BaseModel]] = []
        _REGISTRIES.append(self)

    def register(self, cls: type[S]) -> type[S]:
        """Register a section class under every value of its tag ``Literal`` (a decorator).

        Models that hold this section (see :meth:`attach`) are rebuilt, so a kind registered
        after them -- a plug-in, or a toy algorithm in a test -- validates like the built-in
        ones. A tag registered twice by different classes is an error.
        """
        field = cls.model_fields.get(self.key)
        annotation = None if field is None else field.annotation
        if annotation is None or get_origin(annotation) is not Literal:
            raise TypeError(
                f"{cls.__name__} must declare its {self.section} tag as "
                f"`{self.key}: Literal[...]` to be registered"
            )
        for tag in get_args(annotation):
            other = self._classes.get(tag)
            if other is not None and other is not cls:
                raise ValueError(
                    f"{self.section} {tag!r} is already registered by {other.__qualname__}"
                )
            self._classes[tag] = cls
        for model in self._dependents:
            model.model_rebuild(force=True)
        return cls

    def attach(self, model: type[BaseModel]) -> None:
        """Rebuild ``model`` (which has a field annotated ``Annotated[Base, registry]``)
        whenever a kind is registered later."""
        if model not in self._dependents:
            self._dependents.append(model)
        model.model_rebuild(force=True)

    def __getitem__(self, tag: str) -> type[S]:
        try:
            return self._classes[tag]
        except KeyError:
            raise ConfigError(
                f"config error: {self.section}.{self.key} = {tag!r}: unknown; registered: "
                f"{', '.join(sorted(self._classes))}"
            ) from None

    def __contains__(self, tag: object) -> bool:
        return tag in self._classes

    def __iter__(self) -> Iterator[str]:
        return iter(self._classes)

    def classes(self) -> list[type[S]]:
        """The registered classes, each once, in registration order."""
        return list(dict.fromkeys(self._classes.values()))

    def tags(self) -> set[str]:
        return set(self._classes)

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        choices: dict[Any, CoreSchema] = {}
        schemas: dict[type, CoreSchema] = {}
        for tag, cls in self._classes.items():
            if cls not in schemas:
                schemas[cls] = handler.generate_schema(cls)
            choices[tag] = schemas[cls]
        return core_schema.tagged_union_schema(choices, discriminator=self.key)

    def __repr__(self) -> str:
        return f"Registry({self.section!r}, {sorted(self._classes)})"


T = TypeVar("T")
C = TypeVar("C")


class Named(Generic[T]):
    """The choices of a config setting that names one (``[runtime] backend = "batched"``):
    each registered under its name, looked up by it -- the setting's value picks a registered
    class or function, with no ladder of ``if value == ...`` anywhere.

    >>> GREETINGS: Named[Callable[[str], str]] = Named("greeting")
    >>> @GREETINGS.register("hello")
    ... def hello(who: str) -> str:
    ...     return f"hello {who}"
    >>> GREETINGS["hello"]("you")
    'hello you'
    >>> GREETINGS["bye"]
    Traceback (most recent call last):
    ...
    radbo.registry.ConfigError: config error: greeting = 'bye': unknown; registered: hello

    Args:
        setting: the setting's dotted name in a run config (``"runtime.backend"``), used in
            messages.
    """

    def __init__(self, setting: str) -> None:
        self.setting = setting
        self._choices: dict[str, T] = {}

    def register(self, name: str) -> Callable[[C], C]:
        """Register the decorated class or function as the choice ``name`` (a name registered
        twice by different things is an error); the decorated thing itself is returned."""

        def add(choice: C) -> C:
            other = self._choices.get(name)
            if other is not None and other is not choice:
                raise ValueError(f"{self.setting} {name!r} is already registered by {other!r}")
            self._choices[name] = cast(T, choice)
            return choice

        return add

    def __getitem__(self, name: str) -> T:
        try:
            return self._choices[name]
        except KeyError:
            raise ConfigError(
                f"config error: {self.setting} = {name!r}: unknown; registered: "
                f"{', '.join(sorted(self._choices))}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._choices

    def __iter__(self) -> Iterator[str]:
        return iter(self._choices)

    def __repr__(self) -> str:
        return f"Named({self.setting!r}, {sorted(self._choices)})"

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        """As the metadata of a text field (``backend: Annotated[str, BACKENDS]``): the value
        must be a name registered *when it is validated* (so a choice registered after the
        config class was made is accepted), and the README reference lists the names."""

        def registered(value: str) -> str:
            if value not in self._choices:
                raise ValueError(f"unknown; registered: {', '.join(sorted(self._choices))}")
            return value

        return core_schema.no_info_after_validator_function(registered, handler(source))


def registries() -> "list[Registry[Any]]":
    """Every registry created so far."""
    return list(_REGISTRIES)


def all_tags() -> set[str]:
    """The tags of every registered kind of every section (pydantic puts them in the location
    of a validation error; the error formatter leaves them out)."""
    return {tag for registry in _REGISTRIES for tag in registry.tags()}
