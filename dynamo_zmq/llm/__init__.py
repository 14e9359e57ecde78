"""The LLM layer: the engine contract, what workers advertise and publish (model adverts and
cards, KV events, load reports), how a model's requests are routed (``ModelRouter``), plugins,
worker-side post-processing and the engine stream contract.

Engines (``engines/``), the worker, the frontend and the KV router (``router/``) all speak these
types; this layer sits on the runtime and knows nothing of HTTP.
"""

from ._advert import ModelAdvert as ModelAdvert
from ._advert import ServedModel as ServedModel
from ._advert import advert_of as advert_of
from ._advert import served_models as served_models
from ._advert import serves as serves
from ._block_hashing import KvHashScheme as KvHashScheme
from ._capabilities import Capability as Capability
from ._engine import LLMEngine as LLMEngine
from ._handoff import ConnectorHandoff as ConnectorHandoff
from ._handoff import DecodeRemotely as DecodeRemotely
from ._handoff import Disaggregation as Disaggregation
from ._handoff import KvHandoff as KvHandoff
from ._handoff import PrefillRemotely as PrefillRemotely
from ._kv_events import MEDIUM_GPU as MEDIUM_GPU
from ._kv_events import AllBlocksCleared as AllBlocksCleared
from ._kv_events import BlockRemoved as BlockRemoved
from ._kv_events import BlockSize as BlockSize
from ._kv_events import BlockStored as BlockStored
from ._kv_events import EventBatch as EventBatch
from ._kv_events import KvEvent as KvEvent
from ._kv_events import OwnBatch as OwnBatch
from ._kv_events import OwnEvent as OwnEvent
from ._kv_events import OwnRemoved as OwnRemoved
from ._kv_events import OwnStored as OwnStored
from ._kv_events import encode_batch as encode_batch
from ._kv_events import encode_own_batch as encode_own_batch
from ._live import LiveRequests as LiveRequests
from ._load import LOAD_HEARTBEAT as LOAD_HEARTBEAT
from ._load import LOAD_TOPIC as LOAD_TOPIC
from ._load import LOAD_VERSION as LOAD_VERSION
from ._load import MAX_LOAD_INTERVAL as MAX_LOAD_INTERVAL
from ._load import MAX_REPORT_BYTES as MAX_REPORT_BYTES
from ._load import LoadDecodeError as LoadDecodeError
from ._load import LoadReport as LoadReport
from ._load import decode_report as decode_report
from ._load import encode_report as encode_report
from ._messages import EmbeddingOptions as EmbeddingOptions
from ._messages import EngineConfig as EngineConfig
from ._messages import EngineLoad as EngineLoad
from ._messages import FinishReason as FinishReason
from ._messages import GuidedDecoding as GuidedDecoding
from ._messages import LLMEngineOutput as LLMEngineOutput
from ._messages import MediaItem as MediaItem
from ._messages import OutputOptions as OutputOptions
from ._messages import PreprocessedRequest as PreprocessedRequest
from ._messages import Resume as Resume
from ._messages import RoutingHints as RoutingHints
from ._messages import SamplingOptions as SamplingOptions
from ._messages import StopConditions as StopConditions
from ._messages import ToolCallDelta as ToolCallDelta
from ._messages import ToolOptions as ToolOptions
from ._messages import Usage as Usage
from ._messages import cancelled_output as cancelled_output
from ._messages import error_output as error_output
from ._messages import length_output as length_output
from ._messages import stop_output as stop_output
from ._migration import DEFAULT_MIGRATION_LIMIT as DEFAULT_MIGRATION_LIMIT
from ._migration import DEFAULT_STALL_TIMEOUT as DEFAULT_STALL_TIMEOUT
from ._migration import Migration as Migration
from ._migration import resumable as resumable
from ._model_card import CARD_FILES as CARD_FILES
from ._model_card import CHUNK as CHUNK
from ._model_card import CardFile as CardFile
from ._model_card import ModelCard as ModelCard
from ._model_card import build_card as build_card
from ._model_card import read_card_file as read_card_file
from ._own_ledger import OwnHashLedger as OwnHashLedger
from ._plugins import ENGINES as ENGINES
from ._plugins import ROUTERS as ROUTERS
from ._plugins import TOKENIZERS as TOKENIZERS
from ._plugins import load_plugin as load_plugin
from ._plugins import plugin_names as plugin_names
from ._postprocess import IncrementalDetokenizer as IncrementalDetokenizer
from ._postprocess import PostProcessor as PostProcessor
from ._postprocess import postprocess as postprocess
from ._postprocess import resumed_usage as resumed_usage
from ._postprocess import with_resumed_usage as with_resumed_usage
from ._routing import BUILTIN_MODES as BUILTIN_MODES
from ._routing import DEFAULT_ROUTE as DEFAULT_ROUTE
from ._routing import ClientRouter as ClientRouter
from ._routing import ModelRouter as ModelRouter
from ._routing import OutputStream as OutputStream
from ._routing import RouteOptions as RouteOptions
from ._routing import RouterPlugin as RouterPlugin
from ._routing import RoutingTarget as RoutingTarget
from ._sessions import DEFAULT_MAX_SESSIONS as DEFAULT_MAX_SESSIONS
from ._sessions import DEFAULT_SESSION_TTL as DEFAULT_SESSION_TTL
from ._sessions import NO_SESSIONS as NO_SESSIONS
from ._sessions import SessionConfig as SessionConfig
from ._sessions import SessionPins as SessionPins
from ._sessions import pin_outcome as pin_outcome
from ._stop_strings import MAX_STOP_LENGTH as MAX_STOP_LENGTH
from ._stop_strings import MAX_STOP_STRINGS as MAX_STOP_STRINGS
from ._stop_strings import StopStringMatcher as StopStringMatcher
from ._stop_strings import stop_bounds_error as stop_bounds_error
from ._stream_contract import BadFinishReason as BadFinishReason
from ._stream_contract import ChunkAfterTerminal as ChunkAfterTerminal
from ._stream_contract import ConformanceError as ConformanceError
from ._stream_contract import MultipleTerminals as MultipleTerminals
from ._stream_contract import NotAnOutput as NotAnOutput
from ._stream_contract import NotAStream as NotAStream
from ._stream_contract import NoTerminalChunk as NoTerminalChunk
from ._stream_contract import StreamContractError as StreamContractError
from ._stream_contract import validate_stream as validate_stream

__all__ = [
    "BUILTIN_MODES",
    "CARD_FILES",
    "CHUNK",
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_MIGRATION_LIMIT",
    "DEFAULT_ROUTE",
    "DEFAULT_SESSION_TTL",
    "DEFAULT_STALL_TIMEOUT",
    "ENGINES",
    "LOAD_HEARTBEAT",
    "LOAD_TOPIC",
    "LOAD_VERSION",
    "MAX_LOAD_INTERVAL",
    "MAX_REPORT_BYTES",
    "MAX_STOP_LENGTH",
    "MAX_STOP_STRINGS",
    "MEDIUM_GPU",
    "NO_SESSIONS",
    "ROUTERS",
    "TOKENIZERS",
    "AllBlocksCleared",
    "BadFinishReason",
    "BlockRemoved",
    "BlockSize",
    "BlockStored",
    "Capability",
    "CardFile",
    "ChunkAfterTerminal",
    "ClientRouter",
    "ConformanceError",
    "ConnectorHandoff",
    "DecodeRemotely",
    "Disaggregation",
    "EmbeddingOptions",
    "EngineConfig",
    "EngineLoad",
    "EventBatch",
    "FinishReason",
    "GuidedDecoding",
    "IncrementalDetokenizer",
    "KvEvent",
    "KvHandoff",
    "KvHashScheme",
    "LLMEngine",
    "LLMEngineOutput",
    "LiveRequests",
    "LoadDecodeError",
    "LoadReport",
    "MediaItem",
    "Migration",
    "ModelAdvert",
    "ModelCard",
    "ModelRouter",
    "MultipleTerminals",
    "NoTerminalChunk",
    "NotAStream",
    "NotAnOutput",
    "OutputOptions",
    "OutputStream",
    "OwnBatch",
    "OwnEvent",
    "OwnHashLedger",
    "OwnRemoved",
    "OwnStored",
    "PostProcessor",
    "PrefillRemotely",
    "PreprocessedRequest",
    "Resume",
    "RouteOptions",
    "RouterPlugin",
    "RoutingHints",
    "RoutingTarget",
    "SamplingOptions",
    "ServedModel",
    "SessionConfig",
    "SessionPins",
    "StopConditions",
    "StopStringMatcher",
    "StreamContractError",
    "ToolCallDelta",
    "ToolOptions",
    "Usage",
    "advert_of",
    "build_card",
    "cancelled_output",
    "decode_report",
    "encode_batch",
    "encode_own_batch",
    "encode_report",
    "error_output",
    "length_output",
    "load_plugin",
    "pin_outcome",
    "plugin_names",
    "postprocess",
    "read_card_file",
    "resumable",
    "resumed_usage",
    "served_models",
    "serves",
    "stop_bounds_error",
    "stop_output",
    "validate_stream",
    "with_resumed_usage",
]
