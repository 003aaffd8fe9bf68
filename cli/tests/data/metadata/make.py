#!/usr/bin/env python3
# Makes the metadata-mode test inputs chunks.png, segments.jpg and chunks.webp in the current
# directory: every chunk / segment kind the reference's reader decodes, with damaged variants
# (bad zlib streams, recursive and out-of-range Exif IFD pointers, unknown Exif types).
# The expected outputs beside them (*.txt, *.all-raw.txt, *.json) are what the reference
# sd-cli's `-M metadata` prints for them (see README.md).
import struct, zlib
def chunk(t, b, crc=None):
    c = zlib.crc32(t+b) if crc is None else crc
    return struct.pack('>I', len(b)) + t + b + struct.pack('>I', c)
def tiff(le=True, recursive=False, bad_ptr=False):
    E = '<' if le else '>'
    t = (b'II' if le else b'MM') + struct.pack(E+'HI', 42, 8)
    def ifd(entries, nxt):
        out = struct.pack(E+'H', len(entries))
        for tag, kind, n, v in entries:
            if isinstance(v, bytes): out += struct.pack(E+'HHI', tag, kind, n) + v.ljust(4, b'\0')
            else: out += struct.pack(E+'HHII', tag, kind, n, v)
        return out + struct.pack(E+'I', nxt)
    # IFD0 at 8 with 6 entries: 2+72+4 = 78 -> data at 86
    data_at = 86
    make = b'SDcam\0'
    rat_at = data_at + len(make)          # 92
    srat_at = rat_at + 16                 # 108
    exif_at = srat_at + 8                 # 116
    ents = [(0x010F, 2, len(make), data_at), (0x011A, 5, 2, rat_at), (0x0112, 3, 1, struct.pack(E+'H', 1)),
            (0x8769, 4, 1, exif_at), (0x8825, 4, 1, 0 if not bad_ptr else 99999), (0xBEEF, 10, 1, srat_at)]
    t += ifd(ents, 8 if recursive else 0)
    assert len(t) == data_at
    t += make + struct.pack(E+'IIII', 72, 1, 5, 0) + struct.pack(E+'ii', -3, 4)
    assert len(t) == exif_at
    # Exif IFD: 4 entries 2+48+4=54 -> data at 170
    uc = b'ASCII\0\0\0parameters here'
    d = exif_at + 54
    ex = [(0x9286, 7, len(uc), d), (0xA005, 4, 1, 0), (0x9209, 3, 3, d + len(uc)), (0x1111, 9, 2, d + len(uc) + 6)]
    t += ifd(ex, 0) + uc + struct.pack(E+'HHH', 1, 2, 3) + struct.pack(E+'ii', -5, 6)
    return t
def png(name, chunks):
    open(name, 'wb').write(b'\x89PNG\r\n\x1a\n' + b''.join(chunks))
ihdr = chunk(b'IHDR', struct.pack('>IIBBBBB', 1, 1, 8, 2, 0, 0, 0))
idat = chunk(b'IDAT', zlib.compress(b'\0\x10\x20\x30'))
iend = chunk(b'IEND', b'')
png('chunks.png', [ihdr,
    chunk(b'zTXt', b'parameters\0\0' + zlib.compress(b'zipped params\nSteps: 3')),
    chunk(b'iTXt', b'parameters\0\1\0en\0Params\0' + zlib.compress('ünï params'.encode())),
    chunk(b'iTXt', b'Comment\0\0\0\0\0plain itxt'),
    chunk(b'iTXt', b'Short\0\0\0'),
    chunk(b'iTXt', b'Bad\0\1\0x\0y\0notzlib'),
    chunk(b'zTXt', b'Empty\0\0'),
    chunk(b'zTXt', b'k'),
    chunk(b'tEXt', b'nokey'),
    chunk(b'tEXt', b'Title\0\x01tab\there "q" \\ \x7f'),
    chunk(b'iCCP', b'sRGB profile\0\0' + zlib.compress(bytes(range(100)))),
    chunk(b'eXIf', tiff(True, True)),
    chunk(b'eXIf', tiff(False, False, True)),
    chunk(b'eXIf', b'XX*\0\0\0\0\0'),
    chunk(b'eXIf', b'II+\0\x08\0\0\0'),
    chunk(b'eXIf', b'II'),
    chunk(b'gAMA', struct.pack('>I', 45455)),
    chunk(b'cHRM', struct.pack('>8I', *range(8))),
    chunk(b'sRGB', b'\0'), chunk(b'pHYs', struct.pack('>IIB', 2835, 2835, 1)),
    chunk(b'tIME', struct.pack('>HBBBBB', 2026, 12, 3, 9, 41, 5)),
    chunk(b'teSt', bytes(range(70))), chunk(b'gAMA', b'\0'),
    idat, iend, b'trailing'])
# JPEG
def seg(m, b): return b'\xff' + bytes([m]) + struct.pack('>H', len(b) + 2) + b
jp = b'\xff\xd8' + seg(0xE0, b'JFIF\0\1\2\0\0\1\0\1\0\0') + seg(0xE0, b'JFIF\0\1') + seg(0xE1, b'Exif\0\0' + tiff(False)) \
    + seg(0xE1, b'http://ns.adobe.com/xap/1.0/\0<x:xmpmeta>hi</x:xmpmeta>') + seg(0xE2, b'ICC_PROFILE\0\1\1' + bytes(80)) \
    + seg(0xEE, b'Adobe\0\0\x64\0\0\0\0\1') + b'\xff\xff' + seg(0xFE, b'just a comment\0\0') + seg(0xFE, b'parameters') \
    + seg(0xFE, b'parameters\0x') + b'\xff\x01' + b'\xff\xd0' + seg(0xE5, bytes(3)) + seg(0xE1, b'Exif\0\0II') + seg(0xDB, bytes(65)) + b'\xff\xda\0\2' + bytes(9) + b'\xff\xd9'
open('segments.jpg', 'wb').write(jp)
# WebP
def wc(t, b): return t + struct.pack('<I', len(b)) + b + (b'\0' if len(b) & 1 else b'')
body = wc(b'VP8X', bytes([0x3c, 0, 0, 0, 0x1f, 0x3, 0, 0x0f, 0, 0])) + wc(b'ICCP', bytes(33)) + wc(b'VP8L', bytes(7)) + wc(b'EXIF', tiff(True)) + wc(b'XMP ', b'<xmp>a&amp;b</xmp>\0\0') + wc(b'ALPH', b'')
open('chunks.webp', 'wb').write(b'RIFF' + struct.pack('<I', 4 + len(body)) + b'WEBP' + body)
