"""Link captures that Wireshark/tshark decode as InfiniBand.

One pcapng file holds a whole link direction: interface 0 has link type DLT_USER0 (147) for
data packets (LRH .. VCRC) and interface 1 has DLT_USER1 (148) for flow-control link packets.
tshark maps the user DLTs to the `infiniband` and `infiniband_link` dissectors through the
`user_dlts` UAT (see `TSHARK_DLT_OPTIONS`). pcapng blocks are written little-endian (the
byte-order magic says so); packet bytes are copied as they are on the wire. Timestamps are
integer nanoseconds (if_tsresol = 9), normally simulated cycles x clock period; fractional
nanoseconds are rounded.

tshark 4.0's `infiniband_link` dissector first parses every frame as if it were a data packet
(LRH, and a GRH when the low two FCTBS bits read as LNH = 0b11) to fill its address columns, and
marks a bare 6-byte frame malformed without decoding its fields. `.link()` therefore pads the
recorded frame with zeros to `LINK_FRAME_BYTES`; only its first 6 bytes were on the wire.
"""

import shutil
import struct
import subprocess
from pathlib import Path

DLT_USER0_INFINIBAND = 147
DLT_USER1_INFINIBAND_LINK = 148
DATA_INTERFACE = 0
LINK_INTERFACE = 1
LINK_FRAME_BYTES = 48  # LRH + GRH read as zeros: the least tshark 4.0 decodes for any FCTBS

TSHARK_DLT_OPTIONS = (
    "-o", f'uat:user_dlts:"User 0 (DLT={DLT_USER0_INFINIBAND})","infiniband","0","","0",""',
    "-o", f'uat:user_dlts:"User 1 (DLT={DLT_USER1_INFINIBAND_LINK})","infiniband_link","0","","0",""',
)

_SECTION_HEADER = 0x0A0D0D0A
_INTERFACE_DESCRIPTION = 0x00000001
_ENHANCED_PACKET = 0x00000006
_BYTE_ORDER_MAGIC = 0x1A2B3C4D
_OPT_ENDOFOPT = 0
_OPT_IF_TSRESOL = 9
_TSRESOL_NANOSECONDS = 9  # 10^-9 s


def _pad4(data: bytes) -> bytes:
    return data + bytes(-len(data) % 4)


def _block(block_type: int, body: bytes) -> bytes:
    total_length = 12 + len(body)
    return struct.pack("<II", block_type, total_length) + body + struct.pack("<I", total_length)


def _option(code: int, value: bytes) -> bytes:
    return struct.pack("<HH", code, len(value)) + _pad4(value)


class LinkCapture:
    """pcapng writer for one link: `.data()` for data packets, `.link()` for flow-control packets."""

    def __init__(self, path):
        self.path = Path(path)
        self._file = None

    def __enter__(self):
        self._file = open(self.path, "wb")
        section_length_unknown = -1
        self._file.write(_block(_SECTION_HEADER, struct.pack(
            "<IHHq", _BYTE_ORDER_MAGIC, 1, 0, section_length_unknown)))
        for link_type in (DLT_USER0_INFINIBAND, DLT_USER1_INFINIBAND_LINK):
            options = (_option(_OPT_IF_TSRESOL, bytes([_TSRESOL_NANOSECONDS]))
                       + _option(_OPT_ENDOFOPT, b""))
            snaplen_unlimited = 0
            self._file.write(_block(_INTERFACE_DESCRIPTION,
                                    struct.pack("<HHI", link_type, 0, snaplen_unlimited) + options))
        return self

    def __exit__(self, *exc_info):
        self._file.close()
        self._file = None

    def _packet(self, interface: int, frame: bytes, time_ns) -> None:
        if self._file is None:
            raise RuntimeError("LinkCapture must be used as a context manager")
        timestamp = round(time_ns)
        frame = bytes(frame)
        self._file.write(_block(_ENHANCED_PACKET, struct.pack(
            "<IIIII", interface, timestamp >> 32, timestamp & 0xFFFFFFFF, len(frame), len(frame))
            + _pad4(frame)))

    def data(self, packet_with_vcrc: bytes, time_ns) -> None:
        """Record a data packet, LRH .. VCRC, seen at `time_ns`."""
        self._packet(DATA_INTERFACE, packet_with_vcrc, time_ns)

    def link(self, fc_bytes: bytes, time_ns) -> None:
        """Record a 6-byte flow-control link packet seen at `time_ns` (zero-padded, see module doc)."""
        self._packet(LINK_INTERFACE, bytes(fc_bytes).ljust(LINK_FRAME_BYTES, b"\0"), time_ns)


def _field_value(text: str):
    if text == "":
        return None
    try:
        return int(text, 0)
    except ValueError:
        return text


def tshark_decode(path, fields) -> list[dict]:
    """Decode `path` with tshark; one dict per frame, field name -> int, str, or None if absent.

    Integers come back as int whatever base tshark prints them in.
    Raises FileNotFoundError when tshark is not installed.
    """
    tshark = shutil.which("tshark")
    if tshark is None:
        raise FileNotFoundError("tshark not installed: apt-get install tshark")
    command = [tshark, "-n", "-r", str(path), *TSHARK_DLT_OPTIONS, "-T", "fields",
               "-E", "separator=\t", "-E", "occurrence=f"]
    for field in fields:
        command += ["-e", field]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    frames = []
    for line in result.stdout.splitlines():
        values = line.split("\t")
        frames.append({field: _field_value(value) for field, value in zip(fields, values)})
    return frames


DATA_FIELDS = ("infiniband.lrh.dlid", "infiniband.bth.opcode", "infiniband.bth.destqp",
               "infiniband.bth.psn")


def tshark_data_mismatches(path, packets) -> list[str]:
    """Decode the data frames (interface 0) of the capture at ``path`` with tshark and
    compare them with ``packets`` (LRH .. ICRC, in capture order): DLID, opcode, DestQP and
    PSN must be what :func:`models.packet.parse_packet` reads. Returns the differences."""
    from models.packet import parse_packet
    frames = [f for f in tshark_decode(path, ["frame.interface_id", *DATA_FIELDS])
              if f["frame.interface_id"] == 0]
    if len(frames) != len(packets):
        return [f"{len(frames)} data frames decoded, {len(packets)} packets sent"]
    problems = []
    for n, (frame, packet) in enumerate(zip(frames, packets)):
        parsed = parse_packet(packet)
        sent = (parsed.lrh.dlid, parsed.bth.opcode, parsed.bth.destqp, parsed.bth.psn)
        decoded = tuple(frame[field] for field in DATA_FIELDS)
        if decoded != sent:
            problems.append(f"frame {n}: tshark read {decoded}, sent {sent}")
    return problems
